//! The macros that convert a previous version's records into the current ones: [`record!`] for
//! records whose fields are the same, [`cases!`] for enums and variants whose cases are. Each
//! version's module (`v0_1.rs`, `v0_2/`) writes its conversions with them and the few that
//! differ by hand, so what changed between two versions is what is written out.

/// `impl From<$src> for $dst` of two records with the same fields, each converted with `Into`
/// (a field marked `[each]` element by element).
macro_rules! record {
    (@field [each] $value:expr) => { $value.into_iter().map(Into::into).collect() };
    (@field $value:expr) => { $value.into() };
    ($($sm:ident::$st:ident => $dm:ident::$dt:ident { $($field:ident $([$each:ident])?),* $(,)? })*) => {$(
        impl From<$sm::$st> for $dm::$dt {
            fn from(r: $sm::$st) -> Self {
                Self { $($field: record!(@field $([$each])? r.$field)),* }
            }
        }
    )*};
}
pub(crate) use record;

/// `impl From<$src> for $dst` of two enums or variants with the same cases (payloads
/// converted with `Into`). The match is exhaustive: a case the destination lacks does not
/// compile.
macro_rules! cases {
    ($($sm:ident::$st:ident => $dm:ident::$dt:ident { $($case:ident $(($x:ident))?),* $(,)? })*) => {$(
        impl From<$sm::$st> for $dm::$dt {
            fn from(c: $sm::$st) -> Self {
                match c { $($sm::$st::$case $(($x))? => $dm::$dt::$case $(($x.into()))?),* }
            }
        }
    )*};
}
pub(crate) use cases;
