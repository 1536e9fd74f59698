//! Platform priority configuration: parsing, merging, applying, detection.

mod common;

use common::{capture, register_inplace, register_scaled_rms_norm};
use ir_core::{Availability, ConfigError, ImplSpec, Platform, PriorityConfig, PriorityError, Registry};
use ir_core::{ConfigSources, PlatformChoice, UserPriorities, merge_priorities};
use tracing::Level;

#[test]
fn parses_valid_strings() {
    let parsed = UserPriorities::parse("rms_norm=cpu,native;fused_add_rms_norm=native").unwrap();
    assert_eq!(parsed.get("rms_norm"), Some(&["cpu".to_owned(), "native".to_owned()][..]));
    assert_eq!(parsed.get("fused_add_rms_norm"), Some(&["native".to_owned()][..]));
    let spaced = UserPriorities::parse("  rms_norm = cpu , native ; fused_add_rms_norm=native ;").unwrap();
    assert_eq!(spaced.entries.len(), 2);
    assert_eq!(spaced.get("rms_norm"), parsed.get("rms_norm"));
    let empty_list = UserPriorities::parse("rms_norm=;;").unwrap();
    assert_eq!(empty_list.get("rms_norm"), Some(&[][..]));
    assert!(UserPriorities::parse("").unwrap().entries.is_empty());
    assert!(UserPriorities::parse(" ; ; ").unwrap().entries.is_empty());
}

#[test]
fn each_syntax_error_has_its_position() {
    let cases = [
        ("rms_norm", ConfigError::MissingEquals { position: 0, entry: "rms_norm".into() }),
        ("rms_norm=cpu; fused", ConfigError::MissingEquals { position: 14, entry: "fused".into() }),
        ("=cpu", ConfigError::EmptyOpName { position: 0 }),
        ("rms_norm=cpu;rms_norm=native", ConfigError::DuplicateOp { op: "rms_norm".into(), position: 13 }),
        ("rms_norm=cpu,Bad", ConfigError::InvalidName { name: "Bad".into(), position: 13 }),
        ("rms_norm=cpu, a-b", ConfigError::InvalidName { name: "a-b".into(), position: 14 }),
        ("Rms=cpu", ConfigError::InvalidName { name: "Rms".into(), position: 0 }),
    ];
    for (text, expected) in cases {
        assert_eq!(UserPriorities::parse(text).unwrap_err(), expected, "{text:?}");
    }
    let message = UserPriorities::parse("rms_norm=cpu; fused").unwrap_err().to_string();
    assert_eq!(message, "priority config at byte 14: expected `op=provider,...`, found `fused` (missing `=`)");
}

#[test]
fn merge_rules() {
    let none: [&str; 0] = [];
    assert_eq!(merge_priorities(&none, &["cuda", "native"]), vec!["cuda", "native"]);
    assert_eq!(merge_priorities(&["native"], &["cuda", "native"]), vec!["native", "cuda"]);
    assert_eq!(merge_priorities(&["b", "native"], &["a", "native"]), vec!["b", "native", "a"]);
    assert_eq!(merge_priorities(&["a", "a", "b"], &["b", "c"]), vec!["a", "b", "c"]);
    let once = merge_priorities(&["b", "native"], &["a", "native"]);
    assert_eq!(merge_priorities(&once, &["a", "native"]), once, "merging is idempotent");
}

fn registry_with_platform_providers() -> Registry {
    let registry = ir_ops::registry();
    for name in ["cuda", "cpu"] {
        register_scaled_rms_norm(&registry, ImplSpec::new(name), 2.0);
        register_inplace(&registry, name);
    }
    register_scaled_rms_norm(&registry, ImplSpec::new("b"), 3.0);
    registry
}

#[test]
fn user_native_first_disables_the_platform_provider() {
    let registry = registry_with_platform_providers();
    let config = PriorityConfig {
        platform: PlatformChoice::Pinned(Platform::Cuda),
        user: UserPriorities::parse("rms_norm=native").unwrap(),
    };
    let resolved = config.resolve(&registry).unwrap();
    assert_eq!(resolved.ops["rms_norm"].merged, vec!["native", "cuda"]);
    assert_eq!(resolved.ops["rms_norm"].resolved, vec!["native"]);
    assert_eq!(resolved.ops["fused_add_rms_norm"].resolved, vec!["cuda"]);
}

#[test]
fn applying_installs_every_op_and_logs_once() {
    let registry = registry_with_platform_providers();
    let config = PriorityConfig {
        platform: PlatformChoice::Pinned(Platform::Cpu),
        user: UserPriorities::parse("rms_norm=b,native").unwrap(),
    };
    let (resolved, events) = capture(|| config.apply(&registry).unwrap());
    assert_eq!(resolved.platform, Platform::Cpu);
    assert_eq!(resolved.ops["rms_norm"].merged, vec!["b", "native", "cpu"]);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["b"]));
    assert_eq!(registry.installed_priority("fused_add_rms_norm"), Some(vec!["cpu"]));
    let infos: Vec<_> =
        events.events().into_iter().filter(|e| e.level == Level::INFO && e.target == "ir_core::priority").collect();
    assert_eq!(infos.len(), 1, "{infos:?}");
    assert!(infos[0].message.contains("priorities on cpu: rms_norm=[b]; fused_add_rms_norm=[cpu]"), "{infos:?}");
    assert!(infos[0].fields.contains("user=rms_norm=b,native"), "{infos:?}");
    // Applying again changes nothing.
    let again = config.apply(&registry).unwrap();
    assert_eq!(again, resolved);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["b"]));
}

#[test]
fn scoped_configuration_restores_everything() {
    let registry = registry_with_platform_providers();
    {
        let guard = PriorityConfig::platform_default(Platform::Cuda).apply_scoped(&registry).unwrap();
        assert_eq!(guard.config.platform, Platform::Cuda);
        assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["cuda"]));
        assert_eq!(registry.installed_priority("fused_add_rms_norm"), Some(vec!["cuda"]));
    }
    assert_eq!(registry.installed_priority("rms_norm"), None);
    assert_eq!(registry.installed_priority("fused_add_rms_norm"), None);
}

#[test]
fn unknown_ops_and_providers_are_errors_naming_them() {
    let registry = registry_with_platform_providers();
    let config = PriorityConfig {
        platform: PlatformChoice::Pinned(Platform::Cpu),
        user: UserPriorities::parse("rms_norm=cpu; group_norm=native").unwrap(),
    };
    let err = config.apply(&registry).unwrap_err();
    let known = registry.ops().join(", ");
    assert!(known.starts_with("rms_norm, fused_add_rms_norm"), "{known}");
    assert_eq!(err.to_string(), format!("priority config at byte 14: unknown op `group_norm` (known: {known})"));
    let config = PriorityConfig {
        platform: PlatformChoice::Pinned(Platform::Cpu),
        user: UserPriorities::parse("rms_norm=bogus;fused_add_rms_norm=nope,native").unwrap(),
    };
    let err = config.apply(&registry).unwrap_err();
    let ConfigError::Resolution { errors } = &err else { panic!("{err}") };
    assert_eq!(errors.len(), 2, "every error is collected");
    assert!(matches!(&errors[0], PriorityError::UnknownProvider { unknown, .. } if unknown == &["bogus"]));
    assert!(err.to_string().contains("`bogus`") && err.to_string().contains("`nope`"), "{err}");
    assert_eq!(registry.installed_priority("rms_norm"), None, "nothing installed");
    assert_eq!(registry.installed_priority("fused_add_rms_norm"), None);
}

#[test]
fn every_op_has_a_default_on_every_platform() {
    let bare = ir_ops::registry();
    let full = registry_with_platform_providers();
    for platform in Platform::ALL {
        for registry in [&bare, &full] {
            let resolved = PriorityConfig::platform_default(platform).resolve(registry).unwrap();
            for op in registry.ops() {
                let list = &resolved.ops[op];
                assert!(!list.resolved.is_empty(), "{platform}: {op}");
                assert_eq!(list.merged.last().map(String::as_str), Some("native"), "{platform}: {op}");
            }
        }
    }
    assert_eq!(Platform::Rocm.default_list(&full, "rms_norm"), vec!["native"], "an unregistered provider is left out");
    assert_eq!(Platform::Cpu.default_list(&full, "rms_norm"), vec!["cpu", "native"]);
}

#[test]
fn the_cli_flag_replaces_the_environment_value() {
    let sources = ConfigSources {
        env_priority: Some("rms_norm=native".into()),
        env_platform: Some("cuda".into()),
        cli_priority: Some("rms_norm=cpu".into()),
        cli_platform: None,
    };
    let config = PriorityConfig::from_sources(&sources).unwrap();
    assert_eq!(config.user.get("rms_norm"), Some(&["cpu".to_owned()][..]));
    assert_eq!(config.platform, PlatformChoice::Pinned(Platform::Cuda));
    let env_only = PriorityConfig::from_sources(&ConfigSources { cli_priority: None, ..sources.clone() }).unwrap();
    assert_eq!(env_only.user.get("rms_norm"), Some(&["native".to_owned()][..]));
    let bad_platform = ConfigSources { cli_platform: Some("tpu".into()), ..sources };
    let err = PriorityConfig::from_sources(&bad_platform).unwrap_err();
    assert_eq!(err.to_string(), "unknown platform `tpu` (known: cuda, rocm, xpu, cpu)");
    let detect = PriorityConfig::from_sources(&ConfigSources::default()).unwrap();
    assert_eq!(detect, PriorityConfig::detected());
}

#[test]
fn detection_never_panics_and_falls_back_to_cpu() {
    let registry = ir_ops::registry();
    assert_eq!(Platform::detect(&registry), Platform::Cpu);
    register_scaled_rms_norm(&registry, ImplSpec::new("cuda").with_probe(|| panic!("libcuda.so not found")), 2.0);
    register_scaled_rms_norm(
        &registry,
        ImplSpec::new("rocm").with_probe(|| Availability::Unavailable("built without feature `rocm`".into())),
        2.0,
    );
    assert_eq!(Platform::detect(&registry), Platform::Cpu);
    let with_xpu = ir_ops::registry();
    register_scaled_rms_norm(&with_xpu, ImplSpec::new("xpu"), 2.0);
    assert_eq!(Platform::detect(&with_xpu), Platform::Xpu);
    let cpu_opencl = ir_ops::registry();
    register_scaled_rms_norm(&cpu_opencl, ImplSpec::new("xpu").with_platform_detection(|| false), 2.0);
    assert_eq!(Platform::detect(&cpu_opencl), Platform::Cpu, "an OpenCL CPU device never makes the platform xpu");
    assert_eq!(cpu_opencl.available_providers("rms_norm"), vec!["native", "xpu"]);
}

/// A registry with `cpu` (taking even hidden sizes only, as a kernel provider with a predicate) and
/// nothing else but native.
fn registry_with_even_cpu() -> Registry {
    let registry = ir_ops::registry();
    let even = ImplSpec::new("cpu").with_supports(|args| {
        let hidden = args[0].tensor().expect("x").layout.last_dim();
        if hidden.is_multiple_of(2) { ir_core::Support::Yes } else { ir_core::Support::No("odd hidden size".into()) }
    });
    register_scaled_rms_norm(&registry, even, 2.0);
    registry
}

#[test]
fn a_later_provider_never_joins_in_front_of_the_users_entries() {
    // `VLLM_IR_PRIORITY='rms_norm=native'` (as `from_env` reads it): native first disables the
    // rest, and stays so when an engine registers a provider afterwards.
    let registry = registry_with_even_cpu();
    let sources = ConfigSources {
        env_priority: Some("rms_norm=native".into()),
        env_platform: Some("cpu".into()),
        ..ConfigSources::default()
    };
    PriorityConfig::from_sources(&sources).unwrap().apply(&registry).unwrap();
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["native"]));
    register_scaled_rms_norm(&registry, ImplSpec::new("late"), 3.0);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["native"]), "pinned by the user");

    // A user list of `cpu` alone: the late provider joins after it, before the platform's native.
    let registry = registry_with_even_cpu();
    let config = PriorityConfig {
        platform: PlatformChoice::Pinned(Platform::Cpu),
        user: UserPriorities::parse("rms_norm=cpu").unwrap(),
    };
    config.apply(&registry).unwrap();
    register_scaled_rms_norm(&registry, ImplSpec::new("late"), 3.0);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["cpu", "late"]));

    // The platform's own list (no user entry): the late provider takes what cpu rejects.
    let registry = registry_with_even_cpu();
    PriorityConfig::platform_default(Platform::Cpu).apply(&registry).unwrap();
    register_scaled_rms_norm(&registry, ImplSpec::new("late"), 3.0);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["cpu", "late"]));

    // A scoped configuration pins its user entries the same way.
    let registry = registry_with_even_cpu();
    let scoped = PriorityConfig {
        platform: PlatformChoice::Pinned(Platform::Cpu),
        user: UserPriorities::parse("rms_norm=cpu,native").unwrap(),
    };
    let _guard = scoped.apply_scoped(&registry).unwrap();
    register_scaled_rms_norm(&registry, ImplSpec::new("late"), 3.0);
    assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["cpu", "native"]));
}

/// The same through the real environment variable, in a child process of this test binary (the
/// variable is process-wide, so the parent's other tests never see it).
#[test]
fn the_environment_pins_priorities_against_later_providers() {
    const CHILD: &str = "VLLM_IR_TEST_PINNED_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let registry = registry_with_even_cpu();
        PriorityConfig::from_env().unwrap().apply(&registry).unwrap();
        register_scaled_rms_norm(&registry, ImplSpec::new("late"), 3.0);
        assert_eq!(registry.installed_priority("rms_norm"), Some(vec!["native"]), "pinned by VLLM_IR_PRIORITY");
        assert_eq!(registry.installed_priority("fused_add_rms_norm"), Some(vec!["native"]));
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "the_environment_pins_priorities_against_later_providers", "--test-threads=1"])
        .env(CHILD, "1")
        .env("VLLM_IR_PRIORITY", "rms_norm=native")
        .env("VLLM_IR_PLATFORM", "cpu")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("1 passed"), "the child ran the test:\n{stdout}");
}
