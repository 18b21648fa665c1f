//! Forwarding an export to an older contract version's bindings: [`forward!`] writes the
//! [`Driver`](super::Driver) methods of the exports a version has with the current arguments,
//! and [`Lend`] passes each owned argument the way bindgen's `call_…` methods take it (a string
//! or a list by reference, a plain record by value).
use crate::bindings::types::{CapacityRange, Topology, VolumeCapability};

/// An owned argument as bindgen's generated `call_…` methods take it.
pub(crate) trait Lend {
    type Lent<'a>
    where
        Self: 'a;
    fn lend(&self) -> Self::Lent<'_>;
}

impl Lend for String {
    type Lent<'a> = &'a str;
    fn lend(&self) -> &str {
        self
    }
}

impl<T> Lend for Vec<T> {
    type Lent<'a>
        = &'a [T]
    where
        T: 'a;
    fn lend(&self) -> &[T] {
        self
    }
}

impl<T: Lend> Lend for Option<T> {
    type Lent<'a>
        = Option<T::Lent<'a>>
    where
        T: 'a;
    fn lend(&self) -> Self::Lent<'_> {
        self.as_ref().map(T::lend)
    }
}

/// Records bindgen takes by reference (they hold strings or lists).
macro_rules! by_reference {
    ($($t:ty),*) => {$(
        impl Lend for $t {
            type Lent<'a> = &'a $t;
            fn lend(&self) -> &$t {
                self
            }
        }
    )*};
}

/// Values bindgen takes as they are (numbers, records of numbers).
macro_rules! by_value {
    ($($t:ty),*) => {$(
        impl Lend for $t {
            type Lent<'a> = $t;
            fn lend(&self) -> $t {
                *self
            }
        }
    )*};
}

by_reference!(VolumeCapability, Topology);
by_value!(u32, CapacityRange);

/// `Driver` methods that call the same export of the version's bindgen `Guest` (`self`, its
/// method `call_…`) with the same arguments and convert its answer into the current type with
/// `Into`. Each line is `METHOD = BINDGEN_METHOD(ARGS) -> ANSWER`, the arguments and answer as
/// the `Driver` trait has them.
macro_rules! forward {
    ($($f:ident = $call:ident($($a:ident: $t:ty),*) -> $r:ty;)*) => {$(
        fn $f<'a>(
            &'a self,
            store: &'a mut wasmtime::Store<$crate::state::CallState>,
            $($a: $t),*
        ) -> $crate::compat::driver::CallFuture<'a, $r> {
            use $crate::compat::lend::Lend as _;
            Box::pin(async move {
                let answer = self.$call(store, $($a.lend()),*).await?;
                Ok(answer.map(Into::into))
            })
        }
    )*};
}
pub(crate) use forward;
