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
    /// Calls that ran `native` because every provider listed before it rejected them.
    pub native_fallbacks: u64,
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

    /// What happened between `earlier` (a snapshot of the same registry) and this snapshot: every
    /// count is the difference, each provider's last rejection this snapshot's. An engine takes a
    /// snapshot before a step and attributes the step's selections, copies and fallbacks to it
    /// without resetting the registry's counters, which other threads may be reading.
    ///
    /// ```
    /// # use ir_core::{DType, Registry, Tensor};
    /// let registry = ir_ops::registry();
    /// let x = Tensor::ones(DType::F32, &[2, 8])?;
    /// ir_ops::rms_norm::rms_norm(&registry, &x, None, 1e-6, None)?;
    /// let before = registry.selection_record();
    /// ir_ops::rms_norm::rms_norm(&registry, &x, None, 1e-6, None)?;
    /// let step = registry.selection_record().since(&before);
    /// assert_eq!(step.selections("rms_norm", "native"), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn since(&self, earlier: &SelectionRecord) -> SelectionRecord {
        let ops = self
            .ops
            .iter()
            .map(|now| {
                let before = earlier.op(now.op);
                let provider_before = |provider: &str| {
                    before.and_then(|b| b.providers.iter().find(|p| p.provider == provider)).map_or(0, |p| p.selections)
                };
                OpRecord {
                    op: now.op,
                    inplace_writes: now.inplace_writes.saturating_sub(before.map_or(0, |b| b.inplace_writes)),
                    defensive_copies: now.defensive_copies.saturating_sub(before.map_or(0, |b| b.defensive_copies)),
                    native_fallbacks: now.native_fallbacks.saturating_sub(before.map_or(0, |b| b.native_fallbacks)),
                    providers: now
                        .providers
                        .iter()
                        .map(|p| ProviderRecord {
                            provider: p.provider,
                            selections: p.selections.saturating_sub(provider_before(p.provider)),
                            last_rejection: p.last_rejection.clone(),
                        })
                        .collect(),
                }
            })
            .collect();
        SelectionRecord { ops }
    }

    /// Native fallbacks of every op, summed.
    pub fn native_fallbacks(&self) -> u64 {
        self.ops.iter().map(|op| op.native_fallbacks).sum()
    }

    /// Defensive copies of every op, summed.
    pub fn defensive_copies(&self) -> u64 {
        self.ops.iter().map(|op| op.defensive_copies).sum()
    }
}

/// A table of the ops that ran: per op, the providers chosen (with their counts), the in-place
/// writes, the defensive copies and the native fallbacks.
impl std::fmt::Display for SelectionRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{:<36} {:<20} {:>9} {:>7} {:>17}", "op", "providers", "in place", "copies", "native fallbacks")?;
        for op in self.ops.iter().filter(|op| op.providers.iter().any(|p| p.selections > 0)) {
            let used: Vec<String> = op
                .providers
                .iter()
                .filter(|p| p.selections > 0)
                .map(|p| format!("{} x{}", p.provider, p.selections))
                .collect();
            writeln!(
                f,
                "{:<36} {:<20} {:>9} {:>7} {:>17}",
                op.op,
                used.join(", "),
                op.inplace_writes,
                op.defensive_copies,
                op.native_fallbacks
            )?;
        }
        Ok(())
    }
}

impl Registry {
    /// A snapshot of the selection record.
    pub fn selection_record(&self) -> SelectionRecord {
        let entries: Vec<_> = self.with_ops(|ops| ops.values().cloned().collect());
        let ops = entries
            .iter()
            .map(|entry| OpRecord {
                op: entry.def.name,
                inplace_writes: entry.inplace_writes.load(Ordering::Relaxed),
                defensive_copies: entry.defensive_copies.load(Ordering::Relaxed),
                native_fallbacks: entry.native_fallbacks.load(Ordering::Relaxed),
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

    /// Counts a copy of an argument of `op` made outside dispatch (by an adapter that could not lend
    /// it), so the record shows every copy a call cost.
    pub fn count_defensive_copy(&self, op: &str) {
        if let Some(entry) = self.with_ops(|ops| ops.get(op).cloned()) {
            entry.defensive_copies.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a selection of `native` past the providers listed before it (`rejected`: each with
    /// its reason) made outside eager dispatch (a graph lowered to `native`), and says so once per
    /// op and reason at WARN level; a strict registry refuses it with
    /// [`CallError::NativeFallback`](crate::CallError::NativeFallback) instead.
    pub fn count_native_fallback(&self, op: &str, rejected: &[crate::Rejection]) -> Result<(), crate::CallError> {
        let Some(entry) = self.with_ops(|ops| ops.get(op).cloned()) else { return Ok(()) };
        let listed: Vec<String> = rejected.iter().map(|r| format!("{}: {}", r.provider, r.reason)).collect();
        let rejected = format!("[{}]", listed.join(", "));
        if self.is_strict() {
            return Err(crate::CallError::NativeFallback { op: entry.def.name, rejected });
        }
        entry.native_fallbacks.fetch_add(1, Ordering::Relaxed);
        crate::registry::dispatch::warn_native_fallback(&entry, &rejected);
        Ok(())
    }

    /// Clears the selection record.
    pub fn reset_selection_record(&self) {
        let entries: Vec<_> = self.with_ops(|ops| ops.values().cloned().collect());
        for entry in entries {
            entry.inplace_writes.store(0, Ordering::Relaxed);
            entry.defensive_copies.store(0, Ordering::Relaxed);
            entry.native_fallbacks.store(0, Ordering::Relaxed);
            for imp in read(&entry.impls).iter() {
                imp.selections.store(0, Ordering::Relaxed);
                *lock(&imp.last_rejection) = None;
            }
        }
    }
}
