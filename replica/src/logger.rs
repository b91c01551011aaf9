//! The one bridge from raft-rs's `slog` logging to `tracing` (target `raft`): record
//! levels map one to one, key-value pairs are appended to the message.

use std::fmt::Write as _;

use slog::{KV, Level, OwnedKVList, Record};

struct TracingDrain;

struct Pairs(String);

impl slog::Serializer for Pairs {
    fn emit_arguments(&mut self, key: slog::Key, val: &std::fmt::Arguments<'_>) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl slog::Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record<'_>, values: &OwnedKVList) -> Result<(), slog::Never> {
        // Cheap exit when nobody listens at this level.
        let enabled = match record.level() {
            Level::Critical | Level::Error => {
                tracing::enabled!(target: "raft", tracing::Level::ERROR)
            }
            Level::Warning => tracing::enabled!(target: "raft", tracing::Level::WARN),
            Level::Info => tracing::enabled!(target: "raft", tracing::Level::INFO),
            Level::Debug => tracing::enabled!(target: "raft", tracing::Level::DEBUG),
            Level::Trace => tracing::enabled!(target: "raft", tracing::Level::TRACE),
        };
        if !enabled {
            return Ok(());
        }
        let mut pairs = Pairs(String::new());
        let _ = record.kv().serialize(record, &mut pairs);
        let _ = values.serialize(record, &mut pairs);
        let msg = format!("{}{}", record.msg(), pairs.0);
        match record.level() {
            Level::Critical | Level::Error => tracing::error!(target: "raft", "{msg}"),
            Level::Warning => tracing::warn!(target: "raft", "{msg}"),
            Level::Info => tracing::info!(target: "raft", "{msg}"),
            Level::Debug => tracing::debug!(target: "raft", "{msg}"),
            Level::Trace => tracing::trace!(target: "raft", "{msg}"),
        }
        Ok(())
    }
}

/// A root `slog` logger whose records go to `tracing`.
pub fn raft_logger() -> slog::Logger {
    slog::Logger::root(TracingDrain, slog::o!())
}
