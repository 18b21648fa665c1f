//! `types`: the records and the error every interface uses. It has no functions, but the world
//! imports it, so the linker needs an instance of it, with an (empty) host implementation on a
//! view of nothing.
use crate::bindings::types::{self as wit, Host};
use wasmtime::component::{HasData, LinkerInstance};

/// `types` for the linker: a view of nothing.
pub struct Types;

impl HasData for Types {
    type Data<'a> = Types;
}

impl Host for Types {}

/// Link `types` into `instance` (named as the component's contract version names it).
pub fn add_to_instance<T: Send + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Types>(instance, |_| Types)
}
