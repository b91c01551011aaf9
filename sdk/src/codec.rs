//! How values cross process boundaries: arguments and results are serde
//! values encoded with `postcard`; each argument travels separately so the
//! executor decodes exactly the types the function declares.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::TaskFailure;
use crate::object_ref::ObjectRef;

/// One encoded argument as the executor receives it.
pub type ArgBytes = Vec<u8>;

/// What a task produced: one value, or a stream of values (generator tasks).
pub enum Encoded {
    Value(Vec<u8>),
    /// Values from a foreign runtime (one per return object) and their nested refs.
    Foreign(crate::foreign::ForeignReturn),
    Stream(Box<dyn Iterator<Item = Result<Vec<u8>, TaskFailure>> + Send>),
}

/// An argument of a remote call as the submitter holds it: a value, or a
/// reference that is resolved to its value before the function runs (Ray
/// resolves top-level `ObjectRef` arguments the same way).
pub enum Arg {
    /// An encoded value and the refs nested inside it (pinned by the
    /// submitter until the task ends, CORE-2).
    Value(Vec<u8>, Vec<crate::object_ref::RawRef>),
    Ref(crate::object_ref::RawRef),
}

/// Values and refs that can be passed where a remote function takes `T`.
pub trait IntoArg<T> {
    fn into_arg(self) -> Arg;
}

impl<T: Serialize> IntoArg<T> for T {
    fn into_arg(self) -> Arg {
        let (bytes, nested) = crate::object_ref::capture_nested(|| encode(&self));
        Arg::Value(bytes, nested)
    }
}

impl<T> IntoArg<T> for ObjectRef<T> {
    fn into_arg(self) -> Arg {
        Arg::Ref(self.raw().clone())
    }
}

impl<T> IntoArg<T> for &ObjectRef<T> {
    fn into_arg(self) -> Arg {
        Arg::Ref(self.raw().clone())
    }
}

/// Encodes a value.
///
/// # Panics
/// When the value's `Serialize` impl fails (a serde bug in user code; the
/// standard derives never fail).
pub fn encode<T: Serialize + ?Sized>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("value serializes")
}

/// Decodes a value of type `T`.
///
/// # Errors
/// The bytes are not a `T` (a type mismatch between caller and callee).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    // Refs inside register as borrowed in one batch per owner (CORE-2).
    crate::core::begin_borrow_batch();
    let r = postcard::from_bytes(bytes);
    crate::core::end_borrow_batch();
    r.map_err(|e| {
        format!("cannot decode a {} from {} bytes: {e}", std::any::type_name::<T>(), bytes.len())
    })
}

#[doc(hidden)]
pub fn check_arity(name: &str, got: usize, want: usize) -> Result<(), TaskFailure> {
    if got == want {
        Ok(())
    } else {
        Err(TaskFailure::bad_arguments(format!("{name} takes {want} arguments, got {got}")))
    }
}

#[doc(hidden)]
pub fn decode_arg<T: DeserializeOwned>(
    name: &str,
    index: usize,
    bytes: &[u8],
) -> Result<T, TaskFailure> {
    decode(bytes).map_err(|e| TaskFailure::bad_arguments(format!("{name}: argument {index}: {e}")))
}

thread_local! {
    /// Refs nested in the return value encoded last on this thread (the
    /// executor hands them to the caller, CORE-2).
    static RETURN_NESTED: std::cell::RefCell<Vec<crate::object_ref::RawRef>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Takes the refs nested in the last return value encoded on this thread.
pub(crate) fn take_return_nested() -> Vec<crate::object_ref::RawRef> {
    RETURN_NESTED.with(|r| std::mem::take(&mut *r.borrow_mut()))
}

fn encode_return<T: Serialize>(v: &T) -> Vec<u8> {
    let (bytes, nested) = crate::object_ref::capture_nested(|| encode(v));
    RETURN_NESTED.with(|r| *r.borrow_mut() = nested);
    bytes
}

#[doc(hidden)]
pub fn encode_value<T: Serialize>(v: &T) -> Result<Encoded, TaskFailure> {
    Ok(Encoded::Value(encode_return(v)))
}

#[doc(hidden)]
pub fn encode_result<T: Serialize, E: std::fmt::Display>(
    r: Result<T, E>,
) -> Result<Encoded, TaskFailure> {
    match r {
        Ok(v) => Ok(Encoded::Value(encode_return(&v))),
        Err(e) => Err(TaskFailure::application(e.to_string())),
    }
}

#[doc(hidden)]
pub fn encode_generator<T: Serialize + 'static>(
    g: crate::Generator<T>,
) -> Result<Encoded, TaskFailure> {
    Ok(Encoded::Stream(Box::new(g.0.map(|v| Ok(encode(&v))))))
}

/// Bytes that encode as one length-prefixed block (a plain `Vec<u8>` goes
/// through serde one byte at a time). Use it for large binary payloads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Blob(pub Vec<u8>);

impl Serialize for Blob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Blob {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Blob;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Blob, E> {
                Ok(Blob(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Blob, E> {
                Ok(Blob(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Blob, A::Error> {
                let mut out = Vec::with_capacity(a.size_hint().unwrap_or(0));
                while let Some(b) = a.next_element()? {
                    out.push(b);
                }
                Ok(Blob(out))
            }
        }
        d.deserialize_bytes(V)
    }
}
