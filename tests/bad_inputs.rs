//! The bad-input catalogue: every erroneous input gets a typed error naming the culprit, and the
//! legal edge cases give the correct result. IR text cases live in `tests/bad_inputs/*.ir`.

use ir_core::Call;
use std::path::Path;

use ir_core::op::Overload;
use ir_core::{Availability, CallError, DType, Layout, PriorityConfig, Registry, Tensor, allclose, bit_eq};
use ir_core::{ConfigSources, UserPriorities};
use ir_graph::{InterpError, InterpOptions, interpret, parse, verify};
use ir_ops::fused_add_rms_norm;
use ir_ops::rms_norm::{self, rms_norm};
use ir_passes::{PassContext, Pipeline, Snapshots};

fn registry() -> Registry {
    let registry = ir_ops::registry();
    kernels_cpu::register(&registry).unwrap();
    kernels_cuda::register(&registry).unwrap();
    registry.set_default("rms_norm", &["cpu", "native"]).unwrap();
    registry.set_default("fused_add_rms_norm", &["cpu", "native"]).unwrap();
    registry
}

/// Parse → verify → standard pipeline; the first error's message.
fn first_error(text: &str, registry: &Registry) -> Option<String> {
    let mut graph = match parse(text) {
        Ok(graph) => graph,
        Err(e) => return Some(e.to_string()),
    };
    if let Err(e) = verify(&graph, registry) {
        return Some(e.to_string());
    }
    Pipeline::standard()
        .run(&mut graph, &PassContext::new(registry), None, Snapshots::Skip)
        .err()
        .map(|e| e.to_string())
}

#[test]
fn every_ir_file_in_the_catalogue_reports_its_error() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bad_inputs");
    let registry = registry();
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "ir") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let expected =
            text.lines().find_map(|l| l.strip_prefix("// expect-error: ")).expect("each file names its error");
        let message = first_error(&text, &registry).unwrap_or_else(|| panic!("{}: no error", path.display()));
        assert!(message.contains(expected), "{}: `{message}` lacks `{expected}`", path.display());
        count += 1;
    }
    assert!(count >= 30, "{count} files");
}

#[test]
fn eager_calls_name_the_culprit() {
    let registry = registry();
    let x = Tensor::zeros(DType::BF16, &[4, 8]).unwrap();
    let err = rms_norm(&registry, &x, Some(&Tensor::zeros(DType::BF16, &[7]).unwrap()), 1e-6, None).unwrap_err();
    assert!(err.to_string().contains("`weight` has shape [7]") && err.to_string().contains("[4, 8]"), "{err}");
    for eps in [-1e-6, f64::NAN, f64::INFINITY] {
        let err = rms_norm(&registry, &x, None, eps, None).unwrap_err();
        assert!(matches!(err, CallError::Meta(_)) && err.to_string().contains("epsilon"), "{err}");
    }
    let err = registry.run(Call::new("rms_norm", Overload::Default, vec![])).unwrap_err();
    assert_eq!(err.to_string(), "op `rms_norm`: missing argument for parameter `x`");
    let err = registry.run(Call::new("group_norm", Overload::Default, vec![])).unwrap_err();
    let known = registry.ops().join(", ");
    assert!(known.starts_with("rms_norm, fused_add_rms_norm"), "{known}");
    assert_eq!(err.to_string(), format!("unknown op `group_norm` (known: {known})"));
}

#[test]
fn legal_edge_cases_give_correct_results() {
    let registry = registry();
    // Zero tokens and hidden size 0: empty outputs.
    for shape in [[0usize, 8], [4, 0]] {
        let x = Tensor::zeros(DType::BF16, &shape).unwrap();
        assert_eq!(rms_norm(&registry, &x, None, 1e-6, None).unwrap().shape(), &shape);
        let (out, res) = fused_add_rms_norm::maybe_inplace(
            &registry,
            x.clone(),
            x.deep_clone().unwrap(),
            None,
            1e-6,
            None,
            ir_ops::Rounding::Exact,
        )
        .unwrap();
        assert_eq!((out.shape(), res.shape()), (&shape[..], &shape[..]));
    }
    // A transposed input the kernels cannot take: native runs, with the right values.
    let base = Tensor::from_f64(DType::F32, &[8, 4], &(0..32).map(|i| f64::from(i) / 7.0).collect::<Vec<_>>()).unwrap();
    let transposed = base.transpose(0, 1).unwrap();
    let selection = registry
        .select(
            "rms_norm",
            &[
                ir_core::op::ArgMeta::Tensor(transposed.meta()),
                ir_core::op::ArgMeta::None,
                ir_core::op::ArgMeta::F64(1e-6),
            ],
        )
        .unwrap();
    assert_eq!(selection.provider, "native");
    let y = rms_norm(&registry, &transposed, None, 1e-6, None).unwrap();
    assert!(bit_eq(&y, &rms_norm::native(&transposed.contiguous().unwrap(), None, 1e-6, None).unwrap()));
    // x and residual of different dtypes: the in-place kernel refuses, native computes it.
    let x = Tensor::from_f64(DType::BF16, &[2, 8], &[0.5; 16]).unwrap();
    let r = Tensor::from_f64(DType::F32, &[2, 8], &[0.25; 16]).unwrap();
    let (out, res) =
        fused_add_rms_norm::maybe_inplace(&registry, x.clone(), r.clone(), None, 1e-6, None, ir_ops::Rounding::Exact)
            .unwrap();
    let (expected_out, expected_res) =
        fused_add_rms_norm::native(&x, &r, None, 1e-6, None, ir_ops::Rounding::Exact).unwrap();
    assert!(bit_eq(&out, &expected_out) && bit_eq(&res, &expected_res));
    // A padded, misaligned input (offset one element): the scalar path, same values.
    let storage = Tensor::zeros(DType::BF16, &[4 * 11 + 1]).unwrap();
    let mut padded = storage.as_strided(Layout::new(&[4, 8], &[11, 1], 1).unwrap()).unwrap();
    drop(storage);
    padded
        .copy_from(&Tensor::from_f64(DType::BF16, &[4, 8], &(0..32).map(f64::from).collect::<Vec<_>>()).unwrap())
        .unwrap();
    let y = rms_norm(&registry, &padded, None, 1e-6, None).unwrap();
    allclose(&y, &rms_norm::native(&padded, None, 1e-6, None).unwrap(), 1e-3, 1.6e-2).unwrap();
}

#[test]
fn a_missing_gpu_driver_is_a_reason_not_a_panic() {
    let registry = registry();
    let cuda = registry.providers("rms_norm").into_iter().find(|p| p.name == "cuda").unwrap();
    let Availability::Unavailable(reason) = cuda.availability else {
        // A machine with a GPU: nothing to check here.
        return;
    };
    assert!(!reason.is_empty());
    let graph = parse(
        "graph g(%x: f32[2,8]) {\n  %y = impl rms_norm[cuda] (%x, none, 1e-6, none) : f32[2,8]\n  output(%y)\n}\n",
    )
    .unwrap();
    let x = Tensor::zeros(DType::F32, &[2, 8]).unwrap();
    let err = interpret(&graph, &registry, vec![("x".into(), x)], InterpOptions::checked()).unwrap_err();
    assert!(matches!(&err, InterpError::Call { .. }), "{err}");
    assert!(err.to_string().contains("provider `cuda` of `rms_norm` is unavailable"), "{err}");
    let err = registry.override_priority("rms_norm", &["cuda"]).map(|_| ()).err();
    assert!(err.is_none(), "an unavailable provider in a list is skipped, not an error");
    assert_eq!(registry.resolve_priority("rms_norm", &["cuda"]).unwrap(), vec!["native"]);
}

#[test]
fn malformed_priority_configuration() {
    let registry = registry();
    let cases: &[(&str, &str)] = &[
        ("rms_norm", "missing `=`"),
        ("=cpu", "empty op name"),
        ("rms_norm=cpu;rms_norm=native", "listed twice"),
        ("rms_norm=Cpu", "invalid name `Cpu`"),
        ("group_norm=cpu", "unknown op `group_norm`"),
        ("rms_norm=bogus", "unknown provider `bogus`"),
    ];
    for (text, expected) in cases {
        let message = UserPriorities::parse(text)
            .and_then(|user| PriorityConfig { platform: ir_core::PlatformChoice::Detect, user }.apply(&registry))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(message.contains(expected), "{text}: `{message}` lacks `{expected}`");
    }
    let err =
        PriorityConfig::from_sources(&ConfigSources { env_platform: Some("tpu".into()), ..ConfigSources::default() })
            .unwrap_err();
    assert!(err.to_string().contains("unknown platform `tpu`"));
}
