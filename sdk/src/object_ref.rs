//! Object references. An [`ObjectRef<T>`] names an object and its owner (the
//! process that created it). Clones share one count; when the last copy in
//! the owner process drops and no in-flight task uses the object, the owner
//! frees it (CORE-2).

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::Error;

struct RefInner {
    id: String,
    owner: String,
    /// Whether this ref counts towards the object's lifetime (CORE-2).
    counted: bool,
}

impl Drop for RefInner {
    fn drop(&mut self) {
        if self.counted {
            crate::core::release_ref(&self.id, &self.owner);
        }
    }
}

thread_local! {
    /// Refs serialized on this thread while a capture is active: the refs
    /// nested inside an argument value, which the submitter pins.
    static CAPTURE: std::cell::RefCell<Option<Vec<RawRef>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f`, returning also every ref it serialized.
pub(crate) fn capture_nested<R>(f: impl FnOnce() -> R) -> (R, Vec<RawRef>) {
    let prev = CAPTURE.with(|c| c.borrow_mut().replace(Vec::new()));
    let r = f();
    let nested =
        CAPTURE.with(|c| std::mem::replace(&mut *c.borrow_mut(), prev)).unwrap_or_default();
    (r, nested)
}

/// An untyped reference: object id and owner address.
#[derive(Clone)]
pub struct RawRef(Arc<RefInner>);

impl RawRef {
    pub(crate) fn new(id: String, owner: String) -> Self {
        crate::core::add_ref(&id, &owner);
        Self(Arc::new(RefInner { id, owner, counted: true }))
    }
    /// A ref used only inside the SDK while something else keeps the object
    /// alive (a task's pinned argument): it never changes any count.
    pub(crate) fn uncounted(id: String, owner: String) -> Self {
        Self(Arc::new(RefInner { id, owner, counted: false }))
    }
    /// Wraps a reference whose count the owner already holds for it.
    pub(crate) fn adopt(id: String, owner: String) -> Self {
        Self(Arc::new(RefInner { id, owner, counted: true }))
    }
    pub fn id(&self) -> &str {
        &self.0.id
    }
    pub fn owner(&self) -> &str {
        &self.0.owner
    }
}

impl std::fmt::Debug for RawRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectRef({})", self.id())
    }
}

impl Serialize for RawRef {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        CAPTURE.with(|c| {
            if let Some(v) = c.borrow_mut().as_mut() {
                v.push(self.clone());
            }
        });
        (self.id(), self.owner()).serialize(s)
    }
}

impl<'de> Deserialize<'de> for RawRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (id, owner) = <(String, String)>::deserialize(d)?;
        Ok(RawRef::new(id, owner))
    }
}

/// A typed reference to a value of type `T` that exists or will exist
/// somewhere in the cluster. Serializable: pass it inside other values to
/// hand the object to another task without fetching it.
pub struct ObjectRef<T> {
    raw: RawRef,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for ObjectRef<T> {
    fn clone(&self) -> Self {
        Self { raw: self.raw.clone(), _t: PhantomData }
    }
}

impl<T> std::fmt::Debug for ObjectRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.raw.fmt(f)
    }
}

impl<T> ObjectRef<T> {
    pub(crate) fn from_raw(raw: RawRef) -> Self {
        Self { raw, _t: PhantomData }
    }
    /// The untyped reference.
    pub fn raw(&self) -> &RawRef {
        &self.raw
    }
    /// The object id (32 hex characters).
    pub fn id(&self) -> &str {
        self.raw.id()
    }
}

impl<T: DeserializeOwned> ObjectRef<T> {
    /// Waits for the value (as `tpuray::get(&r)`).
    ///
    /// # Errors
    /// The task's error, a lost object, or a decode mismatch.
    pub fn get(&self) -> Result<T, Error> {
        crate::get(self)
    }
    /// Waits at most `timeout` for the value.
    ///
    /// # Errors
    /// [`Error::Timeout`] when it is not ready in time, else as [`ObjectRef::get`].
    pub fn get_timeout(&self, timeout: Duration) -> Result<T, Error> {
        crate::get_timeout(self, timeout)
    }
}

impl<T> Serialize for ObjectRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.raw.serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for ObjectRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self::from_raw(RawRef::deserialize(d)?))
    }
}

/// The items of a streaming generator task, as refs in the order produced;
/// `next` blocks until the next item exists or the stream ends.
pub struct ObjectRefGenerator<T> {
    pub(crate) task_id: String,
    pub(crate) function: String,
    pub(crate) next: u64,
    pub(crate) _t: PhantomData<fn() -> T>,
}

impl<T> Iterator for ObjectRefGenerator<T> {
    type Item = Result<ObjectRef<T>, Error>;
    fn next(&mut self) -> Option<Self::Item> {
        let r = crate::core::next_generator_item(&self.task_id, &self.function, self.next)?;
        self.next += 1;
        Some(r.map(ObjectRef::from_raw))
    }
}

impl<T> Drop for ObjectRefGenerator<T> {
    fn drop(&mut self) {
        crate::core::drop_generator(&self.task_id, self.next);
    }
}

/// What a streaming remote function returns: any iterator of values. Each
/// item becomes an object as soon as it is produced.
pub struct Generator<T>(pub Box<dyn Iterator<Item = T> + Send>);

impl<T> Generator<T> {
    pub fn new(it: impl Iterator<Item = T> + Send + 'static) -> Self {
        Self(Box::new(it))
    }
}
