//! The binary's function table: every `#[tpuray::remote]` function and
//! `#[tpuray::actor]` class registers itself here at link time (`inventory`),
//! so a worker started from the same binary finds it by name.

use std::any::Any;
use std::collections::HashMap;
use std::sync::OnceLock;

use crate::codec::{ArgBytes, Encoded};
use crate::error::TaskFailure;

/// Calls a remote function with encoded arguments.
pub type InvokeFn = fn(&[ArgBytes]) -> Result<Encoded, TaskFailure>;
/// Calls an actor method on the actor's state.
pub type MethodFn = fn(&mut (dyn Any + Send), &[ArgBytes]) -> Result<Encoded, TaskFailure>;
/// Runs an actor's constructor.
pub type ConstructFn = fn(&[ArgBytes]) -> Result<Box<dyn Any + Send>, TaskFailure>;

pub struct RemoteFunction {
    pub name: &'static str,
    pub invoke: InvokeFn,
}

pub struct ActorClass {
    pub name: &'static str,
    pub construct: ConstructFn,
    pub methods: &'static [(&'static str, MethodFn)],
}

inventory::collect!(RemoteFunction);
inventory::collect!(ActorClass);

fn functions() -> &'static HashMap<&'static str, InvokeFn> {
    static T: OnceLock<HashMap<&'static str, InvokeFn>> = OnceLock::new();
    T.get_or_init(|| {
        inventory::iter::<RemoteFunction>.into_iter().map(|f| (f.name, f.invoke)).collect()
    })
}

fn classes() -> &'static HashMap<&'static str, &'static ActorClass> {
    static T: OnceLock<HashMap<&'static str, &'static ActorClass>> = OnceLock::new();
    T.get_or_init(|| inventory::iter::<ActorClass>.into_iter().map(|c| (c.name, c)).collect())
}

/// The function registered as `name`.
pub fn function(name: &str) -> Option<InvokeFn> {
    functions().get(name).copied()
}

/// The actor class registered as `name`.
pub fn class(name: &str) -> Option<&'static ActorClass> {
    classes().get(name).copied()
}

impl ActorClass {
    pub fn method(&self, name: &str) -> Option<MethodFn> {
        self.methods.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
    }
}
