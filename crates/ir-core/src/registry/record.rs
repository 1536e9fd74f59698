//! The selection record: what eager dispatch chose, per op and provider.

use std::sync::atomic::Ordering;

use crate::registry::{Registry, lock, read};

/// A snapshot of the selection record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectionRecord {
    /// One entry per op, in definition order.
    pub ops: Vec<OpRecord>,
}

/// Eager dispatch statistics of one op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpRecord {
    /// The op.
    pub op: &'static str,
    /// Activations an in-place kernel wrote directly (donated and uniquely owned).
    pub inplace_writes: u64,
    /// Activations copied before an in-place kernel ran (functional calls, shared donations).
    pub defensive_copies: u64,
    /// Per provider, in registration order.
    pub providers: Vec<ProviderRecord>,
}

/// Eager dispatch statistics of one provider of one op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderRecord {
    /// The provider.
    pub provider: &'static str,
    /// How many eager calls selected it.
    pub selections: u64,
    /// The reason its predicate last rejected a call, if it ever did.
    pub last_rejection: Option<String>,
}

impl SelectionRecord {
    /// The record of `op`.
    pub fn op(&self, op: &str) -> Option<&OpRecord> {
        self.ops.iter().find(|r| r.op == op)
    }

    /// How many eager calls of `op` selected `provider`.
    pub fn selections(&self, op: &str, provider: &str) -> u64 {
        self.op(op).and_then(|r| r.providers.iter().find(|p| p.provider == provider)).map_or(0, |p| p.selections)
    }
}

impl Registry {
    /// A snapshot of the selection record.
    pub fn selection_record(&self) -> SelectionRecord {
        let entries: Vec<_> = self.ops.load().values().cloned().collect();
        let ops = entries
            .iter()
            .map(|entry| OpRecord {
                op: entry.def.name,
                inplace_writes: entry.inplace_writes.load(Ordering::Relaxed),
                defensive_copies: entry.defensive_copies.load(Ordering::Relaxed),
                providers: read(&entry.impls)
                    .iter()
                    .map(|imp| ProviderRecord {
                        provider: imp.provider,
                        selections: imp.selections.load(Ordering::Relaxed),
                        last_rejection: lock(&imp.last_rejection).as_deref().map(str::to_owned),
                    })
                    .collect(),
            })
            .collect();
        SelectionRecord { ops }
    }

    /// Clears the selection record.
    pub fn reset_selection_record(&self) {
        let entries: Vec<_> = self.ops.load().values().cloned().collect();
        for entry in entries {
            entry.inplace_writes.store(0, Ordering::Relaxed);
            entry.defensive_copies.store(0, Ordering::Relaxed);
            for imp in read(&entry.impls).iter() {
                imp.selections.store(0, Ordering::Relaxed);
                *lock(&imp.last_rejection) = None;
            }
        }
    }
}
