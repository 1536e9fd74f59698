//! Priority lists: resolution ("filter"), the per-op stack of installed lists, and scoped guards.

use std::sync::Arc;

use crate::Availability;
use crate::registry::{ImplEntry, NATIVE, OpEntry, Registry, lock, read};

/// A resolved, installed priority list.
pub(crate) type Resolved = Arc<[Arc<ImplEntry>]>;

/// A priority list that cannot be installed. Nothing is installed when this is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PriorityError {
    /// The op is not defined.
    #[error("unknown op `{op}` (known: {})", known.join(", "))]
    UnknownOp {
        /// The op.
        op: String,
        /// Ops the registry defines.
        known: Vec<String>,
    },
    /// Names in the list that are not registered for the op.
    #[error(
        "unknown provider{} {} in priority list for `{op}` (known: {})",
        if unknown.len() == 1 { "" } else { "s" },
        unknown.iter().map(|u| format!("`{u}`")).collect::<Vec<_>>().join(", "),
        known.join(", ")
    )]
    UnknownProvider {
        /// The op.
        op: String,
        /// The names not registered.
        unknown: Vec<String>,
        /// The providers registered for the op.
        known: Vec<String>,
    },
}

/// The per-op stack: a permanent default at the bottom, guard layers above it. Each list keeps the
/// names it was resolved from, so replacing an implementation can resolve it again.
#[derive(Default)]
pub(crate) struct PriorityStack {
    default: Option<Layer>,
    layers: Vec<(u64, Layer)>,
    next_layer: u64,
}

/// One installed list: the names asked for, how many of the first ones a user listed (pinned),
/// and what resolution made of them.
struct Layer {
    names: Vec<String>,
    /// `names[..pinned]` ends with the last name a user listed (in this list or one it was merged
    /// with); the names after it came from a platform's defaults.
    pinned: usize,
    resolved: Resolved,
}

impl Layer {
    fn new(names: &[impl AsRef<str>], pinned: usize, resolved: Resolved) -> Layer {
        Layer { names: names.iter().map(|n| n.as_ref().to_owned()).collect(), pinned, resolved }
    }
}

impl PriorityStack {
    pub(crate) fn top(&self) -> Option<Resolved> {
        self.layers.last().map(|(_, layer)| &layer.resolved).or(self.default.as_ref().map(|l| &l.resolved)).cloned()
    }

    /// The names of the list on top (the innermost guard's, else the default's), and how many of
    /// the first are pinned.
    fn top_names(&self) -> (Vec<String>, usize) {
        self.layers
            .last()
            .map(|(_, layer)| layer)
            .or(self.default.as_ref())
            .map(|l| (l.names.clone(), l.pinned))
            .unwrap_or_default()
    }

    /// Adds a provider registered after lists were installed to every list, after the names a
    /// user listed and before the platform's `native` that follows them (else last), and resolves
    /// them again. A list whose user entries end in `native` (or another provider that takes every
    /// argument) therefore never reaches it: a pinned list stays as the user wrote it.
    pub(crate) fn join(&mut self, entry: &OpEntry, provider: &str) {
        let layers = self.default.iter_mut().chain(self.layers.iter_mut().map(|(_, layer)| layer));
        for layer in layers {
            if layer.names.iter().any(|n| n == provider) {
                continue;
            }
            let platform_native = layer.names[layer.pinned..].iter().position(|n| n == NATIVE);
            let at = platform_native.map_or(layer.names.len(), |k| layer.pinned + k);
            layer.names.insert(at, provider.to_owned());
            layer.resolved = resolve(entry, &layer.names).expect("every name was registered");
        }
    }

    /// Resolves every list again (after an implementation was replaced); names stay valid because a
    /// replacement keeps the provider's name.
    pub(crate) fn resolve_again(&mut self, entry: &OpEntry) {
        let layers = self.default.iter_mut().chain(self.layers.iter_mut().map(|(_, layer)| layer));
        for layer in layers {
            layer.resolved = resolve(entry, &layer.names).expect("a replacement keeps every name registered");
        }
    }
}

/// Restores the previously installed list of one op when dropped (also during unwinding).
///
/// Guards may be dropped out of order: each removes its own layer.
#[must_use = "the priority list is uninstalled when the guard is dropped"]
pub struct PriorityGuard {
    entry: Arc<OpEntry>,
    layer: u64,
}

impl Drop for PriorityGuard {
    fn drop(&mut self) {
        let mut stack = lock(&self.entry.priority);
        stack.layers.retain(|(id, _)| *id != self.layer);
        self.entry.publish(stack.top());
        tracing::debug!(
            target: "ir_core::priority",
            op = self.entry.def.name,
            installed = %display_list(stack.top().as_deref()),
            "restored priority list"
        );
    }
}

impl std::fmt::Debug for PriorityGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PriorityGuard").field("op", &self.entry.def.name).field("layer", &self.layer).finish()
    }
}

impl Registry {
    /// Resolves `names` for `op` and installs the result as its permanent default. The list is the
    /// caller's own: a provider registered later joins it only at its end (see
    /// [`Registry::register_impl`]), so it is reached only when every name here rejects a call.
    pub fn set_default(&self, op: &str, names: &[impl AsRef<str>]) -> Result<(), PriorityError> {
        self.set_default_pinned(op, names, names.len())
    }

    /// [`Registry::set_default`] of a merged list whose first `pinned` names a user listed and the
    /// rest a platform (the configuration's lists).
    pub(crate) fn set_default_pinned(
        &self,
        op: &str,
        names: &[impl AsRef<str>],
        pinned: usize,
    ) -> Result<(), PriorityError> {
        let entry = self.priority_entry(op)?;
        let resolved = resolve(&entry, names)?;
        let mut stack = lock(&entry.priority);
        stack.default = Some(Layer::new(names, pinned.min(names.len()), resolved));
        entry.publish(stack.top());
        tracing::debug!(target: "ir_core::priority", op, default = %display_list(stack.default.as_ref().map(|l| &*l.resolved)), "set default priority list");
        Ok(())
    }

    /// Installs `names` for `op` until the guard is dropped, with the configuration's merge rule:
    /// your entries first, then the entries of the list installed below (the platform's, or an
    /// enclosing guard's) not already named. `override_priority("rms_norm", &["mine"])` on the CPU
    /// platform installs `[mine, cpu, native]`, never dropping `cpu`.
    ///
    /// Every name given here is pinned, as are those the list below pinned: a provider registered
    /// while the guard is alive joins the list after them (see [`Registry::register_impl`]).
    pub fn override_priority(&self, op: &str, names: &[impl AsRef<str>]) -> Result<PriorityGuard, PriorityError> {
        self.override_priority_pinned(op, names, names.len())
    }

    /// [`Registry::override_priority`] of a list whose first `pinned` names a user listed and the
    /// rest a platform (the configuration's scoped lists).
    pub(crate) fn override_priority_pinned(
        &self,
        op: &str,
        names: &[impl AsRef<str>],
        pinned: usize,
    ) -> Result<PriorityGuard, PriorityError> {
        let entry = self.priority_entry(op)?;
        let (below, below_pinned) = lock(&entry.priority).top_names();
        let merged = merge_priorities(names, &below);
        // The pinned prefix ends at the last name a user listed, here or below.
        let user_names = names[..pinned.min(names.len())].iter().map(AsRef::as_ref);
        let user_names: Vec<&str> = user_names.chain(below[..below_pinned].iter().map(String::as_str)).collect();
        let pinned = merged.iter().rposition(|name| user_names.contains(&name.as_str())).map_or(0, |last| last + 1);
        let resolved = resolve(&entry, &merged)?;
        Ok(install_layer(entry, Layer::new(&merged, pinned, resolved)))
    }

    /// The installed, resolved list of `op` (`None` when nothing is installed or the op is unknown).
    pub fn installed_priority(&self, op: &str) -> Option<Vec<&'static str>> {
        let entry = self.entry(op).ok()?;
        let installed = entry.installed.load_full()?;
        Some(installed.iter().filter(|i| i.is_available()).map(|i| i.provider).collect())
    }

    /// Resolves a list without installing it (what `set_default` would install).
    pub fn resolve_priority(&self, op: &str, names: &[impl AsRef<str>]) -> Result<Vec<&'static str>, PriorityError> {
        let entry = self.priority_entry(op)?;
        Ok(resolve(&entry, names)?.iter().filter(|i| i.is_available()).map(|i| i.provider).collect())
    }

    pub(crate) fn priority_entry(&self, op: &str) -> Result<Arc<OpEntry>, PriorityError> {
        self.entry(op).map_err(|known| PriorityError::UnknownOp { op: op.to_owned(), known })
    }
}

fn install_layer(entry: Arc<OpEntry>, layer_data: Layer) -> PriorityGuard {
    let mut stack = lock(&entry.priority);
    let layer = stack.next_layer;
    stack.next_layer += 1;
    stack.layers.push((layer, layer_data));
    entry.publish(stack.top());
    tracing::debug!(target: "ir_core::priority", op = entry.def.name, installed = %display_list(stack.top().as_deref()), "installed scoped priority list");
    drop(stack);
    PriorityGuard { entry, layer }
}

/// Resolution: check names, skip unavailable providers, stop after the first provider without a
/// predicate, and append `native` (with a warning) when no such provider was reached.
fn resolve(entry: &OpEntry, names: &[impl AsRef<str>]) -> Result<Resolved, PriorityError> {
    let op = entry.def.name;
    let impls = read(&entry.impls).clone();
    let find = |name: &str| impls.iter().find(|i| i.provider == name);
    let unknown: Vec<String> =
        names.iter().map(AsRef::as_ref).filter(|name| find(name).is_none()).map(str::to_owned).collect();
    if !unknown.is_empty() {
        let known = impls.iter().map(|i| i.provider.to_owned()).collect();
        return Err(PriorityError::UnknownProvider { op: op.to_owned(), unknown, known });
    }
    let mut resolved: Vec<Arc<ImplEntry>> = Vec::new();
    let mut unconditional = false;
    for (position, name) in names.iter().map(AsRef::as_ref).enumerate() {
        let candidate = find(name).expect("unknown names were rejected above");
        if let Availability::Unavailable(reason) = candidate.availability() {
            // Kept: dispatch skips it as a rejection, so a call that falls past it to native is a
            // fallback (counted, said, refused by a strict registry).
            tracing::debug!(target: "ir_core::priority", op, provider = name, reason = reason.as_str(), "skipping unavailable provider (a call that falls past it to native is a fallback)");
            resolved.push(Arc::clone(candidate));
            continue;
        }
        resolved.push(Arc::clone(candidate));
        if candidate.supports.is_none() {
            unconditional = true;
            let unreachable = &names[position + 1..];
            if !unreachable.is_empty() {
                let unreachable: Vec<&str> = unreachable.iter().map(AsRef::as_ref).collect();
                tracing::debug!(
                    target: "ir_core::priority",
                    op,
                    after = name,
                    unreachable = ?unreachable,
                    "providers after one that supports all arguments are unreachable"
                );
            }
            break;
        }
    }
    if !unconditional {
        resolved.push(Arc::clone(find(NATIVE).expect("every op has a native implementation")));
        entry.warn_once("no-unconditional-provider", || {
            format!(
                "op {op}: no provider in the priority list supports all arguments; calls may fall back to native; \
                 add `native` at the end of the list to silence this"
            )
        });
    }
    Ok(resolved.into())
}

pub(crate) fn display_list(list: Option<&[Arc<ImplEntry>]>) -> String {
    match list {
        None => "none".to_owned(),
        Some(list) => format!("[{}]", list.iter().map(|i| i.provider).collect::<Vec<_>>().join(", ")),
    }
}

/// User entries first, in order, then the platform entries not already present; duplicates collapse
/// to their first occurrence. Idempotent.
pub fn merge_priorities(user: &[impl AsRef<str>], platform: &[impl AsRef<str>]) -> Vec<String> {
    let mut merged: Vec<String> = Vec::new();
    for name in user.iter().map(AsRef::as_ref).chain(platform.iter().map(AsRef::as_ref)) {
        if !merged.iter().any(|m| m == name) {
            merged.push(name.to_owned());
        }
    }
    merged
}
