//! Platforms, priority configuration and how user and platform lists merge ([`PriorityConfig`]
//! documents them).

use std::fmt;
use std::str::FromStr;

use indexmap::IndexMap;

use crate::op::is_valid_name;
use crate::registry::merge_priorities;
use crate::registry::{NATIVE, PriorityError, PriorityGuard, Registry};

/// The environment variable holding user overrides.
pub const PRIORITY_ENV: &str = "VLLM_IR_PRIORITY";
/// The environment variable pinning the platform.
pub const PLATFORM_ENV: &str = "VLLM_IR_PLATFORM";

/// A hardware platform; it decides the default provider of every op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Platform {
    /// NVIDIA GPUs (`cuda`).
    Cuda,
    /// AMD GPUs (`rocm`).
    Rocm,
    /// Intel GPUs (`xpu`).
    Xpu,
    /// Host CPUs (`cpu`).
    Cpu,
}

impl Platform {
    /// Every platform, in detection order.
    pub const ALL: [Platform; 4] = [Platform::Cuda, Platform::Rocm, Platform::Xpu, Platform::Cpu];

    /// The provider this platform prefers.
    pub fn provider(self) -> &'static str {
        match self {
            Platform::Cuda => "cuda",
            Platform::Rocm => "rocm",
            Platform::Xpu => "xpu",
            Platform::Cpu => "cpu",
        }
    }

    /// Picks the first of Cuda, Rocm, Xpu whose provider is registered and available (and, where the
    /// provider says so, backed by a GPU), else Cpu. Never panics: probes that panic count as unavailable.
    pub fn detect(registry: &Registry) -> Platform {
        let detected = [Platform::Cuda, Platform::Rocm, Platform::Xpu]
            .into_iter()
            .find(|platform| registry.provider_detects_platform(platform.provider()))
            .unwrap_or(Platform::Cpu);
        tracing::debug!(target: "ir_core::priority", platform = %detected, "detected platform");
        detected
    }

    /// The platform's default list for `op`: its provider if registered for the op, then `native`.
    pub fn default_list(self, registry: &Registry, op: &str) -> Vec<&'static str> {
        let provider = self.provider();
        let registered = registry.providers(op).iter().any(|p| p.name == provider);
        if registered {
            return vec![provider, NATIVE];
        }
        tracing::debug!(target: "ir_core::priority", op, provider, "platform provider is not registered for this op");
        vec![NATIVE]
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.provider())
    }
}

impl FromStr for Platform {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Platform, ConfigError> {
        match s.trim() {
            "cuda" => Ok(Platform::Cuda),
            "rocm" => Ok(Platform::Rocm),
            "xpu" => Ok(Platform::Xpu),
            "cpu" => Ok(Platform::Cpu),
            other => Err(ConfigError::UnknownPlatform { name: other.to_owned() }),
        }
    }
}

/// Errors of priority configuration: syntax (with byte positions) and resolution.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    // --- syntax of the override string ---
    /// An entry without `=`.
    #[error("priority config at byte {position}: expected `op=provider,...`, found `{entry}` (missing `=`)")]
    MissingEquals {
        /// Byte offset of the entry.
        position: usize,
        /// The entry.
        entry: String,
    },
    /// An entry with nothing before `=`.
    #[error("priority config at byte {position}: empty op name")]
    EmptyOpName {
        /// Byte offset of the entry.
        position: usize,
    },
    /// An op listed twice.
    #[error("priority config at byte {position}: op `{op}` is listed twice")]
    DuplicateOp {
        /// The op.
        op: String,
        /// Byte offset of the second entry.
        position: usize,
    },
    /// A provider or op name that fails `^[a-z_][a-z_0-9]*$`.
    #[error("priority config at byte {position}: invalid name `{name}` (names match ^[a-z_][a-z_0-9]*$)")]
    InvalidName {
        /// The name.
        name: String,
        /// Its byte offset.
        position: usize,
    },

    // --- meaning ---
    /// An op the registry does not define.
    #[error("priority config at byte {position}: unknown op `{op}` (known: {})", known.join(", "))]
    UnknownOp {
        /// The op.
        op: String,
        /// Its byte offset.
        position: usize,
        /// Ops the registry defines.
        known: Vec<String>,
    },
    /// A platform name other than cuda, rocm, xpu, cpu.
    #[error("unknown platform `{name}` (known: cuda, rocm, xpu, cpu)")]
    UnknownPlatform {
        /// The name.
        name: String,
    },
    /// Lists that cannot be resolved; all of them are reported.
    #[error("invalid priority configuration: {}", errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Resolution {
        /// One error per op.
        errors: Vec<PriorityError>,
    },
}

/// One `op=providers` entry of a user override.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserEntry {
    /// The op.
    pub op: String,
    /// The providers, in order (may be empty).
    pub providers: Vec<String>,
    /// Byte offset of the op name in the source string.
    pub position: usize,
}

/// Parsed user overrides, in the order written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserPriorities {
    /// The entries.
    pub entries: Vec<UserEntry>,
    /// The source string, for logs.
    pub source: String,
}

impl UserPriorities {
    /// No overrides.
    pub fn none() -> UserPriorities {
        UserPriorities { entries: Vec::new(), source: String::new() }
    }

    /// Parses `rms_norm=cpu,native;fused_add_rms_norm=native`: entries split by `;`, op and list by
    /// `=`, providers by `,`; whitespace trimmed; empty entries ignored; `op=` is an empty list.
    pub fn parse(source: &str) -> Result<UserPriorities, ConfigError> {
        let mut entries: Vec<UserEntry> = Vec::new();
        let mut start = 0;
        for raw in source.split(';') {
            let entry_start = start;
            start += raw.len() + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let position = entry_start + (raw.len() - raw.trim_start().len());
            let Some((op_raw, list_raw)) = raw.split_once('=') else {
                return Err(ConfigError::MissingEquals { position, entry: raw.trim().to_owned() });
            };
            let op = op_raw.trim();
            if op.is_empty() {
                return Err(ConfigError::EmptyOpName { position });
            }
            if !is_valid_name(op) {
                return Err(ConfigError::InvalidName { name: op.to_owned(), position });
            }
            if entries.iter().any(|e| e.op == op) {
                return Err(ConfigError::DuplicateOp { op: op.to_owned(), position });
            }
            let mut providers = Vec::new();
            let mut item_start = entry_start + op_raw.len() + 1;
            for item in list_raw.split(',') {
                let item_position = item_start + (item.len() - item.trim_start().len());
                item_start += item.len() + 1;
                let name = item.trim();
                if name.is_empty() {
                    continue;
                }
                if !is_valid_name(name) {
                    return Err(ConfigError::InvalidName { name: name.to_owned(), position: item_position });
                }
                providers.push(name.to_owned());
            }
            entries.push(UserEntry { op: op.to_owned(), providers, position });
        }
        Ok(UserPriorities { entries, source: source.to_owned() })
    }

    /// The user's list for `op`, if any.
    pub fn get(&self, op: &str) -> Option<&[String]> {
        self.entries.iter().find(|e| e.op == op).map(|e| e.providers.as_slice())
    }
}

/// Whether the platform is pinned or detected from the registry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlatformChoice {
    /// Detect with [`Platform::detect`].
    Detect,
    /// Use this platform.
    Pinned(Platform),
}

/// Where priorities come from: a platform and the user's overrides.
///
/// Platforms, their default priority lists, user overrides and how they merge.
///
/// A [`PriorityConfig`] names a platform (pinned or detected) and the user's overrides, parsed from
/// the syntax `rms_norm=cpu,native;fused_add_rms_norm=native`. Applying it merges, for every op, the
/// user's entries first and then the platform's, resolves every list (collecting all errors),
/// installs them, and logs the result once at info level on `ir_core::priority`.
///
/// ```
/// use ir_core::{Platform, PlatformChoice, UserPriorities};
/// use ir_core::{PriorityConfig, Registry};
///
/// let registry = ir_ops::registry(); // kernel crates would register their providers here
/// let config = PriorityConfig {
///     platform: PlatformChoice::Pinned(Platform::Cpu),
///     user: UserPriorities::parse("rms_norm=native")?,
/// };
/// let resolved = config.apply(&registry)?;
/// assert_eq!(resolved.ops["rms_norm"].merged[0], "native"); // the user's entries first
/// assert_eq!(registry.installed_priority("rms_norm").unwrap()[0], "native");
/// // An unknown provider is an error naming it; nothing is installed then.
/// let bad = PriorityConfig { platform: PlatformChoice::Pinned(Platform::Cpu), user: UserPriorities::parse("rms_norm=bogus")? };
/// assert!(bad.apply(&registry).unwrap_err().to_string().contains("bogus"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PriorityConfig {
    /// The platform.
    pub platform: PlatformChoice,
    /// The user's overrides.
    pub user: UserPriorities,
}

/// The raw strings a configuration may come from, in order of precedence: CLI over environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigSources {
    /// `VLLM_IR_PRIORITY`.
    pub env_priority: Option<String>,
    /// `VLLM_IR_PLATFORM`.
    pub env_platform: Option<String>,
    /// `--ir-op-priority` (replaces the environment value).
    pub cli_priority: Option<String>,
    /// `--platform` (replaces the environment value).
    pub cli_platform: Option<String>,
}

/// The outcome of resolving a configuration: what is (or would be) installed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedConfig {
    /// The platform used.
    pub platform: Platform,
    /// Per op: the merged list and its resolution.
    pub ops: IndexMap<&'static str, OpPriority>,
}

/// The priority of one op after merging and resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpPriority {
    /// User entries first, then the platform's.
    pub merged: Vec<String>,
    /// What resolution made of it.
    pub resolved: Vec<&'static str>,
}

/// Guards installing a whole configuration; dropping it restores every op's previous list.
#[must_use = "the configuration is uninstalled when the guard is dropped"]
#[derive(Debug)]
pub struct ConfigGuard {
    /// What was installed.
    pub config: ResolvedConfig,
    _guards: Vec<PriorityGuard>,
}

impl PriorityConfig {
    /// A platform's defaults without overrides.
    pub fn platform_default(platform: Platform) -> PriorityConfig {
        PriorityConfig { platform: PlatformChoice::Pinned(platform), user: UserPriorities::none() }
    }

    /// The detected platform's defaults without overrides.
    pub fn detected() -> PriorityConfig {
        PriorityConfig { platform: PlatformChoice::Detect, user: UserPriorities::none() }
    }

    /// Reads `VLLM_IR_PRIORITY` and `VLLM_IR_PLATFORM`. Libraries never call this by themselves.
    pub fn from_env() -> Result<PriorityConfig, ConfigError> {
        PriorityConfig::from_sources(&ConfigSources {
            env_priority: std::env::var(PRIORITY_ENV).ok(),
            env_platform: std::env::var(PLATFORM_ENV).ok(),
            cli_priority: None,
            cli_platform: None,
        })
    }

    /// Builds a configuration from raw strings; a CLI value replaces the environment value.
    pub fn from_sources(sources: &ConfigSources) -> Result<PriorityConfig, ConfigError> {
        let priority = sources.cli_priority.as_deref().or(sources.env_priority.as_deref());
        let platform = sources.cli_platform.as_deref().or(sources.env_platform.as_deref());
        let user = match priority {
            Some(text) => UserPriorities::parse(text)?,
            None => UserPriorities::none(),
        };
        let platform = match platform.map(str::trim) {
            None | Some("") | Some("auto") => PlatformChoice::Detect,
            Some(name) => PlatformChoice::Pinned(name.parse()?),
        };
        Ok(PriorityConfig { platform, user })
    }

    /// Merges and resolves every op's list without installing anything; all errors are collected.
    pub fn resolve(&self, registry: &Registry) -> Result<ResolvedConfig, ConfigError> {
        let platform = match self.platform {
            PlatformChoice::Pinned(platform) => platform,
            PlatformChoice::Detect => Platform::detect(registry),
        };
        let known = registry.ops();
        if let Some(entry) = self.user.entries.iter().find(|e| !known.contains(&e.op.as_str())) {
            return Err(ConfigError::UnknownOp {
                op: entry.op.clone(),
                position: entry.position,
                known: known.iter().map(|k| (*k).to_owned()).collect(),
            });
        }
        let mut ops = IndexMap::new();
        let mut errors = Vec::new();
        for op in known {
            let user: &[String] = self.user.get(op).unwrap_or(&[]);
            let merged = merge_priorities(user, &platform.default_list(registry, op));
            match registry.resolve_priority(op, &merged) {
                Ok(resolved) => {
                    ops.insert(op, OpPriority { merged, resolved });
                }
                Err(error) => errors.push(error),
            }
        }
        if !errors.is_empty() {
            return Err(ConfigError::Resolution { errors });
        }
        Ok(ResolvedConfig { platform, ops })
    }

    /// Resolves, then installs every op's list permanently (`set_default`), and logs the result.
    pub fn apply(&self, registry: &Registry) -> Result<ResolvedConfig, ConfigError> {
        let config = self.resolve(registry)?;
        for (op, priority) in &config.ops {
            registry
                .set_default_pinned(op, &priority.merged, self.pinned(op))
                .map_err(|e| ConfigError::Resolution { errors: vec![e] })?;
        }
        self.log_applied(&config);
        Ok(config)
    }

    /// Resolves, then installs every op's list until the returned guard is dropped.
    pub fn apply_scoped(&self, registry: &Registry) -> Result<ConfigGuard, ConfigError> {
        let config = self.resolve(registry)?;
        let mut guards = Vec::new();
        for (op, priority) in &config.ops {
            let guard = registry
                .override_priority_pinned(op, &priority.merged, self.pinned(op))
                .map_err(|e| ConfigError::Resolution { errors: vec![e] })?;
            guards.push(guard);
        }
        self.log_applied(&config);
        Ok(ConfigGuard { config, _guards: guards })
    }

    /// How many of the first names of `op`'s merged list the user wrote (distinct names: the merge
    /// keeps their first occurrences, in order, in front of the platform's).
    fn pinned(&self, op: &str) -> usize {
        let user: &[String] = self.user.get(op).unwrap_or(&[]);
        merge_priorities(user, &[] as &[&str]).len()
    }

    fn log_applied(&self, config: &ResolvedConfig) {
        let lists: Vec<String> = config.ops.iter().map(|(op, p)| format!("{op}=[{}]", p.resolved.join(", "))).collect();
        tracing::info!(
            target: "ir_core::priority",
            platform = %config.platform,
            user = self.user.source.as_str(),
            "priorities on {}: {}",
            config.platform,
            lists.join("; ")
        );
    }
}
