//! Priority lists: resolution ("filter"), the per-op stack of installed lists, and scoped guards.

use std::sync::Arc;

use crate::Availability;
use crate::registry::{ImplEntry, NATIVE, OpEntry, Registry, lock, read};

/// A resolved, installed priority list.
pub(crate) type Resolved = Arc<[Arc<ImplEntry>]>;

/// A priority list that cannot be installed. Nothing is installed when this is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
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

/// One installed list: the names asked for and what resolution made of them.
struct Layer {
    names: Vec<String>,
    resolved: Resolved,
}

impl Layer {
    fn new(names: &[impl AsRef<str>], resolved: Resolved) -> Layer {
        Layer { names: names.iter().map(|n| n.as_ref().to_owned()).collect(), resolved }
    }
}

impl PriorityStack {
    pub(crate) fn top(&self) -> Option<Resolved> {
        self.layers.last().map(|(_, layer)| &layer.resolved).or(self.default.as_ref().map(|l| &l.resolved)).cloned()
    }

    /// The names of the list on top (the innermost guard's, else the default's).
    fn top_names(&self) -> Vec<String> {
        self.layers
            .last()
            .map(|(_, layer)| layer)
            .or(self.default.as_ref())
            .map(|l| l.names.clone())
            .unwrap_or_default()
    }

    /// Adds a provider registered after lists were installed to every list, before an explicit
    /// `native` (else last), and resolves them again.
    pub(crate) fn join(&mut self, entry: &OpEntry, provider: &str) {
        let layers = self.default.iter_mut().chain(self.layers.iter_mut().map(|(_, layer)| layer));
        for layer in layers {
            if layer.names.iter().any(|n| n == provider) {
                continue;
            }
            let at = layer.names.iter().position(|n| n == NATIVE).unwrap_or(layer.names.len());
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
    /// Resolves `names` for `op` and installs the result as its permanent default.
    pub fn set_default(&self, op: &str, names: &[impl AsRef<str>]) -> Result<(), PriorityError> {
        let entry = self.priority_entry(op)?;
        let resolved = resolve(&entry, names)?;
        let mut stack = lock(&entry.priority);
        stack.default = Some(Layer::new(names, resolved));
        entry.publish(stack.top());
        tracing::debug!(target: "ir_core::priority", op, default = %display_list(stack.default.as_ref().map(|l| &*l.resolved)), "set default priority list");
        Ok(())
    }

    /// Installs `names` for `op` until the guard is dropped, with the configuration's merge rule:
    /// your entries first, then the entries of the list installed below (the platform's, or an
    /// enclosing guard's) not already named. `override_priority("rms_norm", &["mine"])` on the CPU
    /// platform installs `[mine, cpu, native]`, never dropping `cpu`.
    pub fn override_priority(&self, op: &str, names: &[impl AsRef<str>]) -> Result<PriorityGuard, PriorityError> {
        let entry = self.priority_entry(op)?;
        let below = lock(&entry.priority).top_names();
        let merged = crate::platform::merge(names, &below);
        let resolved = resolve(&entry, &merged)?;
        Ok(install_layer(entry, Layer::new(&merged, resolved)))
    }

    /// The installed, resolved list of `op` (`None` when nothing is installed or the op is unknown).
    pub fn installed_priority(&self, op: &str) -> Option<Vec<&'static str>> {
        let entry = self.entry(op).ok()?;
        let installed = entry.installed.load_full()?;
        Some(installed.list.iter().map(|i| i.provider).collect())
    }

    /// Resolves a list without installing it (what `set_default` would install).
    pub fn resolve_priority(&self, op: &str, names: &[impl AsRef<str>]) -> Result<Vec<&'static str>, PriorityError> {
        let entry = self.priority_entry(op)?;
        Ok(resolve(&entry, names)?.iter().map(|i| i.provider).collect())
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
            tracing::debug!(target: "ir_core::priority", op, provider = name, reason = reason.as_str(), "skipping unavailable provider");
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
