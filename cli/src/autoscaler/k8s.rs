//! The `kubernetes` provider (behind the `kubernetes` cargo feature).
