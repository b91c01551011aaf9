//! Typed ids that cannot be mixed up. On the wire they are lowercase hex
//! strings (a UUID v4 without dashes); an empty string means "none".

use std::fmt;

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        pub struct $name(String);

        impl $name {
            /// A new random id.
            pub fn random() -> Self {
                Self(uuid::Uuid::new_v4().simple().to_string())
            }
            /// Wraps an id received on the wire.
            pub fn from_wire(s: impl Into<String>) -> Self {
                Self(s.into())
            }
            /// The wire form.
            pub fn as_str(&self) -> &str {
                &self.0
            }
            /// The first 8 characters, for logs and tables.
            pub fn short(&self) -> &str {
                &self.0[..self.0.len().min(8)]
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.short())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

typed_id!(
    /// A node (one node agent).
    NodeId
);
typed_id!(
    /// A job (one driver).
    JobId
);
typed_id!(
    /// An actor.
    ActorId
);
typed_id!(
    /// A worker process.
    WorkerId
);
typed_id!(
    /// A worker lease granted by a node agent.
    LeaseId
);
typed_id!(
    /// A task.
    TaskId
);
typed_id!(
    /// An object.
    ObjectId
);
typed_id!(
    /// A placement group.
    PlacementGroupId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_roundtrip_through_wire_form() {
        let id = NodeId::random();
        assert_eq!(id.as_str().len(), 32);
        assert_eq!(NodeId::from_wire(id.to_string()), id);
        assert_eq!(id.short().len(), 8);
    }
}
