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
    // The compiled decoder fuses each layer's two norms with their fp8 quantizations, in place on
    // the residual, and rotates q and k (slices of one qkv buffer) on the cpu, each in its own call
    // written inside the buffer: the donating graph keeps none of lowering's copies.
    assert!(stdout.contains("fused 6 norm + quantization pair(s)"), "{stdout}");
    assert!(stdout.contains("fused_add_rms_norm_static_fp8_quant=cpu×6"), "{stdout}");
    assert!(stdout.contains("rotary_embedding=cpu×6"), "{stdout}");
    assert!(stdout.contains("0 left after clone elimination"), "{stdout}");
    assert!(stdout.contains("rotary_embedding: cpux3"), "{stdout}");
    assert!(stdout.contains("silu_and_mul=cpu×3"), "{stdout}");
    assert!(stdout.contains("compiled bit-identical to eager: yes"), "{stdout}");
}

#[test]
fn demo_rejects_bad_sizes() {
    let (ok, _, stderr) = vllm_ir(&["demo", "--hidden", "0"], &[]);
    assert!(!ok);
    assert_eq!(stderr.trim(), "error: --layers, --tokens and --hidden must be at least 1");
    let (ok, _, stderr) = vllm_ir(&["demo", "--hidden", "12"], &[]);
    assert!(!ok);
    assert!(stderr.contains("--hidden 12: ToyDecoder: hidden size 12 must be a multiple of 8"), "{stderr}");
}

/// A test's temporary file or folder (`vllm-ir-cli-<pid>-<name>` in the temporary directory),
/// removed when the test ends, whether it passes or fails.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        Scratch(std::env::temp_dir().join(format!("vllm-ir-cli-{}-{name}", std::process::id())))
    }
}

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.0.is_dir() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn golden_input(relative: &str) -> Scratch {
    let text = std::fs::read_to_string(format!("{}/../../tests/ir/{relative}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let input = text.split("// expect:").next().unwrap();
    let path = Scratch::new(&relative.replace('/', "-"));
    std::fs::write(&*path, input).unwrap();
    path
}

#[test]
fn opt_prints_the_optimized_graph_and_reports() {
    let path = golden_input("pipeline/model-a.ir");
    let (ok, stdout, stderr) = vllm_ir(&["opt", path.to_str().unwrap(), "--timing"], &[]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("%o1, %s1 = impl fused_add_rms_norm[cpu] writes(0, 1) (%x, %r1, %w, 1e-6, none)"),
        "{stdout}"
    );
    assert!(stderr.contains("functionalize: functionalized 2 call(s)"), "{stderr}");
    assert!(stderr.contains(" ms)"), "{stderr}");
    let (ok, stdout, _) = vllm_ir(&["opt", path.to_str().unwrap(), "--dot"], &[]);
    assert!(ok && stdout.starts_with("digraph"), "{stdout}");
    let dump = Scratch::new("dump");
    let (ok, _, stderr) = vllm_ir(&["opt", path.to_str().unwrap(), "--dump-dir", dump.to_str().unwrap()], &[]);
    assert!(ok, "{stderr}");
    let index = std::fs::read_to_string(dump.join("index.md")).unwrap();
    assert!(index.contains("| 1 | functionalize |") && index.contains("08-dce.ir"), "{index}");
    assert!(dump.join("00-input.ir").is_file());
}

/// Runs the binary with `stdin` as standard input.
fn vllm_ir_stdin(args: &[&str], stdin: &str) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-ir"))
        .args(args)
        .env_remove("VLLM_IR_PRIORITY")
        .env_remove("VLLM_IR_PLATFORM")
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    child.stdin.take().expect("piped").write_all(stdin.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into(),
        String::from_utf8_lossy(&output.stderr).into(),
    )
}

#[test]
fn opt_follows_mlir_opt_conventions() {
    let text = std::fs::read_to_string(&*golden_input("pipeline/model-a.ir")).unwrap();
    // `-` reads stdin; with --print-after-all the dumps go to stderr and stdout is exactly the result.
    let (ok, stdout, stderr) = vllm_ir_stdin(&["opt", "-", "--print-after-all"], &text);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("// input\n") && stderr.contains("// after lower\n"), "{stderr}");
    assert!(!stdout.contains("//"), "{stdout}");
    let reparsed = ir_graph::parse(&stdout).expect("stdout parses back");
    let (_, plain, _) = vllm_ir_stdin(&["opt", "-"], &text);
    assert_eq!(stdout, plain, "the same result with and without dumps");
    assert_eq!(reparsed.to_string(), plain);
    // --dot works with --print-after-all; -o writes the result to a file.
    let out = Scratch::new("out.dot");
    let (ok, stdout, stderr) =
        vllm_ir_stdin(&["opt", "-", "--print-after-all", "--dot", "-o", out.to_str().unwrap()], &text);
    assert!(ok && stdout.is_empty(), "{stdout}{stderr}");
    assert!(std::fs::read_to_string(&*out).unwrap().starts_with("digraph"));
    assert!(stderr.contains("// after eliminate-clones\n"), "{stderr}");
    // Errors on stdin name it.
    let (ok, _, stderr) = vllm_ir_stdin(&["opt", "-"], "graph g(%x: f32[2]) {\n  output(%y)\n}\n");
    assert!(!ok && stderr.starts_with("<stdin>:2:"), "{stderr}");
}

#[test]
fn run_compares_before_and_after() {
    let path = golden_input("pipeline/model-c.ir");
    let out = Scratch::new("out.safetensors");
    let (ok, stdout, stderr) =
        vllm_ir(&["run", path.to_str().unwrap(), "--seed", "3", "--save-outputs", out.to_str().unwrap()], &[]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("outputs bit-identical: yes"), "{stdout}");
    assert!(std::fs::metadata(&*out).unwrap().len() > 4 * 128 * 2);
    let unsafe_qkv = golden_input("eliminate-clones/qkv-view-read-after-write.unsafe.ir");
    let (ok, _, stderr) = vllm_ir(
        &["run", unsafe_qkv.to_str().unwrap(), "--passes", "eliminate-clones", "--clone-elimination", "unsafe"],
        &[],
    );
    assert!(!ok);
    assert!(stderr.contains("overwrites the storage of `%qkv`"), "{stderr}");
}

#[test]
fn malformed_files_are_one_line_errors() {
    let path = Scratch::new("bad.ir");
    std::fs::write(&*path, "graph g(%x: f32[2]) {\n  %y = scale(%x 2.0) : f32[2]\n}\n").unwrap();
    let (ok, _, stderr) = vllm_ir(&["opt", path.to_str().unwrap()], &[]);
    assert!(!ok);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let expected = format!("{}:2:17: error: expected ',' or ')', found '2.0'", path.display());
    assert_eq!(stderr.trim_end(), expected, "compiler-style: FILE:LINE:COL: error: MESSAGE");
    let (ok, _, stderr) = vllm_ir(&["opt", "/no/such/file.ir"], &[]);
    assert!(!ok && stderr.contains("reading /no/such/file.ir"), "{stderr}");
}

#[test]
fn every_catalogue_file_is_a_one_line_error_for_opt_and_run() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/bad_inputs");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "ir") {
            continue;
        }
        for command in ["opt", "run"] {
            let (ok, _, stderr) = vllm_ir(&[command, path.to_str().unwrap()], &[]);
            assert!(!ok, "{command} {} succeeded", path.display());
            assert!(!stderr.contains("panicked"), "{command} {}: {stderr}", path.display());
            assert_eq!(stderr.lines().count(), 1, "{command} {}: {stderr}", path.display());
            let located = stderr.starts_with(&format!("{}:", path.display())) && stderr.contains(": error: ");
            assert!(located || stderr.starts_with("error: "), "{stderr}");
            let name = path.file_name().unwrap().to_string_lossy();
            if name.starts_with("parse-") && !name.contains("empty") {
                assert!(located, "a syntax error is located: {stderr}");
            }
        }
        count += 1;
    }
    assert!(count >= 30);
}

#[test]
fn run_on_an_input_too_large_for_memory_prints_one_line_and_fails() {
    let dir = Scratch::new("oom");
    std::fs::create_dir_all(&*dir).unwrap();
    let path = dir.join("huge.ir");
    // 2^58 f32 elements: 2^60 bytes, below isize::MAX (so the verifier accepts it) but beyond any
    // address space, so the allocation fails on every machine.
    let text =
        "graph g(%x: f32[288230376151711744]) {\n  %y = scale(%x, 2.0) : f32[288230376151711744]\n  output(%y)\n}\n";
    std::fs::write(&path, text).unwrap();
    let (ok, stdout, stderr) = vllm_ir(&["run", path.to_str().unwrap()], &[]);
    assert!(!ok, "{stdout}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("out of memory: cannot allocate"), "{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("memory allocation of"), "{stderr}");
}

/// Every subcommand ends quietly when its reader closes standard output (`vllm-ir info | head`):
/// the pipe is closed before the first write, so every write fails.
#[test]
fn a_closed_standard_output_ends_every_subcommand_quietly() {
    let model = golden_input("pipeline/model-a.ir");
    let model = model.to_str().unwrap();
    let runs: [&[&str]; 4] =
        [&["info"], &["demo", "--layers", "1", "--tokens", "2", "--hidden", "64"], &["opt", model], &["run", model]];
    for args in runs {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-ir"))
            .args(args)
            .env_remove("VLLM_IR_PRIORITY")
            .env_remove("VLLM_IR_PLATFORM")
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the binary runs");
        drop(child.stdout.take());
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(output.status.success(), "{args:?}: {:?} {stderr}", output.status);
    }
}

/// `VLLM_IR_STRICT` takes the usual boolean spellings; anything else fails naming the variable.
/// With it set, a platform whose providers are all unavailable here falls back on every op, which
/// a strict run refuses.
#[test]
fn strict_values_are_checked_and_unavailable_platforms_fail_strict_runs() {
    let (ok, _, stderr) = vllm_ir(&["info"], &[("VLLM_IR_STRICT", "yes")]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = vllm_ir(&["info"], &[("VLLM_IR_STRICT", "2")]);
    assert!(!ok && stderr.contains("VLLM_IR_STRICT=\"2\""), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    let model = golden_input("pipeline/model-a.ir");
    let (ok, _, stderr) = vllm_ir(&["run", model.to_str().unwrap(), "--platform", "rocm"], &[("VLLM_IR_STRICT", "1")]);
    assert!(!ok, "every op falls back to native without a rocm device: {stderr}");
    assert!(stderr.contains("rocm: unavailable") && stderr.contains("strict"), "{stderr}");
    let (ok, _, stderr) = vllm_ir(&["run", model.to_str().unwrap(), "--platform", "rocm"], &[]);
    assert!(ok, "lenient: native runs, said once: {stderr}");
}
