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

/// The length in bytes of `v`'s encoding (a pass of the serializer that writes
/// nothing).
///
/// # Panics
/// As [`encode`].
pub(crate) fn encoded_len<T: Serialize + ?Sized>(v: &T) -> usize {
    postcard::experimental::serialized_size(v).expect("value serializes")
}

/// Bytes a [`Sink`] gathers before it hands them on: the small pieces (length
/// prefixes, numbers) a serializer emits go out a buffer at a time.
const SINK_BUFFER: usize = 64 * 1024;

/// A postcard flavor that hands an encoding to `out` as it is made, never holding
/// more than [`SINK_BUFFER`] bytes: small pieces are gathered, and a piece at least
/// that large (a [`Blob`]'s bytes) goes to `out` as it is, without a copy here.
struct Sink<'a> {
    buf: Vec<u8>,
    out: &'a mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    /// The error `out` returned (postcard's own error type cannot carry it).
    failed: &'a mut Option<std::io::Error>,
}

impl Sink<'_> {
    fn flush(&mut self) -> postcard::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let r = (self.out)(&self.buf);
        self.buf.clear();
        self.check(r)
    }

    fn check(&mut self, r: std::io::Result<()>) -> postcard::Result<()> {
        r.map_err(|e| {
            *self.failed = Some(e);
            postcard::Error::SerializeBufferFull
        })
    }
}

impl postcard::ser_flavors::Flavor for Sink<'_> {
    type Output = ();

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        if self.buf.len() == SINK_BUFFER {
            self.flush()?;
        }
        self.buf.push(data);
        Ok(())
    }

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        if self.buf.len() + data.len() <= SINK_BUFFER {
            self.buf.extend_from_slice(data);
            return Ok(());
        }
        self.flush()?;
        if data.len() >= SINK_BUFFER {
            let r = (self.out)(data);
            return self.check(r);
        }
        self.buf.extend_from_slice(data);
        Ok(())
    }

    fn finalize(mut self) -> postcard::Result<()> {
        self.flush()
    }
}

/// Encodes `v` as [`encode`] does, handing the bytes to `out` in order as they are
/// made instead of returning them (a large value goes straight into the object
/// store, with no encoded copy in memory).
///
/// # Errors
/// The first error `out` returned (nothing more is handed to it after that).
///
/// # Panics
/// As [`encode`].
pub(crate) fn encode_to<T: Serialize + ?Sized>(
    v: &T,
    out: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut failed = None;
    let sink = Sink { buf: Vec::with_capacity(SINK_BUFFER), out, failed: &mut failed };
    match postcard::serialize_with_flavor::<T, _, ()>(v, sink) {
        Ok(()) => Ok(()),
        Err(e) => match failed {
            Some(io) => Err(io),
            None => panic!("value serializes: {e}"),
        },
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed<T: Serialize>(v: &T) -> (Vec<u8>, Vec<usize>) {
        let (mut all, mut pieces) = (Vec::new(), Vec::new());
        encode_to(v, &mut |p| {
            pieces.push(p.len());
            all.extend_from_slice(p);
            Ok(())
        })
        .unwrap();
        (all, pieces)
    }

    #[test]
    fn a_streamed_encoding_is_the_encoding_and_its_length_is_counted_right() {
        let big = Blob((0..3 * SINK_BUFFER + 17).map(|i| (i % 253) as u8).collect());
        let many: Vec<u32> = (0..100_000).collect();
        let mixed = (7u8, "name".to_string(), Blob(vec![1; SINK_BUFFER - 3]), many.clone());
        let check = |want: Vec<u8>, got: (Vec<u8>, Vec<usize>), len: usize| {
            assert_eq!(len, want.len());
            assert!(got.0 == want, "streamed bytes differ");
            // Never a piece above the buffer, unless one piece was that large on its own.
            assert!(got.1.iter().all(|&n| n > 0));
        };
        check(encode(&big), streamed(&big), encoded_len(&big));
        check(encode(&many), streamed(&many), encoded_len(&many));
        check(encode(&mixed), streamed(&mixed), encoded_len(&mixed));
        check(encode(&0u8), streamed(&0u8), encoded_len(&0u8));
        // A large Blob's bytes are handed over in one piece, as they are.
        assert!(streamed(&big).1.contains(&big.0.len()));
        // Small pieces are gathered: 100,000 numbers come in few pieces, none above the buffer.
        let pieces = streamed(&many).1;
        assert!(pieces.len() < 10 && pieces.iter().all(|&n| n <= SINK_BUFFER), "{pieces:?}");
    }

    #[test]
    fn a_failing_sink_stops_the_encoding_with_its_error() {
        let many: Vec<u32> = (0..100_000).collect();
        let mut calls = 0;
        let r = encode_to(&many, &mut |_| {
            calls += 1;
            Err(std::io::Error::other("store full"))
        });
        assert_eq!(r.unwrap_err().to_string(), "store full");
        assert_eq!(calls, 1, "nothing is handed over after the first error");
    }
}
