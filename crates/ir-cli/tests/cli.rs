//! End-to-end runs of the `vllm-ir` binary.

use std::process::Command;

fn vllm_ir(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_vllm-ir"));
    command.args(args).env_remove("VLLM_IR_PRIORITY").env_remove("VLLM_IR_PLATFORM").env_remove("RUST_LOG");
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().expect("the binary runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into(),
        String::from_utf8_lossy(&output.stderr).into(),
    )
}

#[test]
fn info_lists_ops_providers_and_priorities() {
    let (ok, stdout, stderr) = vllm_ir(&["info"], &[]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("platform: cpu (detected)"), "{stdout}");
    assert!(
        stdout
            .contains("op rms_norm(x: Tensor, weight: Optional[Tensor], epsilon: float, variance_size: Optional[int])"),
        "{stdout}"
    );
    assert!(stdout.contains("op fused_add_rms_norm("), "{stdout}");
    assert!(stdout.contains("provider native"), "{stdout}");
    assert!(stdout.contains("priority: ["), "{stdout}");
}

#[test]
fn info_with_an_unknown_provider_fails_naming_it() {
    let (ok, stdout, stderr) = vllm_ir(&["info"], &[("VLLM_IR_PRIORITY", "rms_norm=bogus")]);
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("`bogus`"), "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one-line message: {stderr}");
}

#[test]
fn the_cli_flag_replaces_the_environment() {
    let (ok, stdout, stderr) =
        vllm_ir(&["info", "--ir-op-priority", "rms_norm=native"], &[("VLLM_IR_PRIORITY", "rms_norm=bogus")]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("user priorities: rms_norm=native"), "{stdout}");
    let (ok, _, stderr) = vllm_ir(&["info", "--ir-op-priority", "rms_norm=cpu;rms_norm=native"], &[]);
    assert!(!ok);
    assert!(stderr.contains("op `rms_norm` is listed twice"), "{stderr}");
    let (ok, _, stderr) = vllm_ir(&["info", "--platform", "tpu"], &[]);
    assert!(!ok);
    assert!(stderr.contains("unknown platform `tpu`"), "{stderr}");
}

#[test]
fn demo_runs_and_is_bit_identical() {
    let (ok, stdout, stderr) = vllm_ir(&["demo", "--layers", "3", "--tokens", "4", "--hidden", "64"], &[]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("bit-identical: yes"), "{stdout}");
    assert!(stdout.contains("fused_add_rms_norm:"), "{stdout}");
    assert!(stdout.contains("bytes allocated"), "{stdout}");
}

#[test]
fn demo_rejects_bad_sizes() {
    let (ok, _, stderr) = vllm_ir(&["demo", "--hidden", "0"], &[]);
    assert!(!ok);
    assert_eq!(stderr.trim(), "error: --layers, --tokens and --hidden must be at least 1");
}
