//! The Llama example's model, on a tiny random checkpoint of each variant (Llama, Gemma, Qwen3,
//! Gemma 3; no download): this
//! project's ops on candle tensors against candle-nn's on the same weights (logits within the
//! dtype's tolerance, the same greedy tokens), with 0 defensive copies and 0 native fallbacks on the
//! cpu platform in prefill and decode, and the in-place ops writing in place; and the model traced
//! with candle's matmuls and attention as engine ops, compiled, bit for bit like eager.

#[path = "../crates/vllm-ir/examples/llama/compiled.rs"]
mod compiled;
#[path = "../crates/vllm-ir/examples/llama/model.rs"]
mod model;

use candle_core::{DType, Tensor};
use model::{Cache, Model, Ops};

/// The example's architectures, by their Hugging Face `model_type`.
const VARIANTS: [&str; 4] = ["llama", "gemma", "qwen3", "gemma3_text"];

fn run(model: &Model, ops: Ops<'_>, prompt: &[u32], decode: usize) -> Vec<Tensor> {
    run_with(model, prompt, decode, |tokens, cache| model.forward(ops, tokens, cache))
}

/// Prefill `prompt`, then `decode` steps of fixed tokens, through `forward`.
fn run_with(
    model: &Model,
    prompt: &[u32],
    decode: usize,
    mut forward: impl FnMut(&[u32], &mut Cache) -> anyhow::Result<Tensor>,
) -> Vec<Tensor> {
    let mut cache = Cache::new(model);
    let mut logits = vec![forward(prompt, &mut cache).unwrap()];
    for step in 0..decode {
        let next = (prompt.len() + step * 13) as u32 % model.config().vocab_size as u32;
        logits.push(forward(&[next], &mut cache).unwrap());
    }
    logits
}

/// A forward step of the model: tokens and the cache, to logits.
type Forward<'a> = dyn FnMut(&[u32], &mut Cache) -> anyhow::Result<Tensor> + 'a;

/// Every element's bits, in f32 (exact for bf16).
fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn the_compiled_model_with_engine_ops_runs_bit_for_bit_like_eager_with_no_copy() {
    for variant in VARIANTS {
        for dtype in [DType::F32, DType::BF16] {
            let label = format!("{variant} {dtype:?}");
            let config = model::tiny_config(variant);
            let model = Model::new(config.clone(), &model::random_weights(&config, dtype, 11).unwrap()).unwrap();
            let prompt: Vec<u32> = (0..24).map(|i| (i * 29 + 5) % 256).collect();
            let mut compiled = compiled::Compiled::new(&model).unwrap();
            let eager = run_with(&model, &prompt, 3, |tokens, cache| compiled.forward_eager(tokens, cache));
            let graph = run_with(&model, &prompt, 3, |tokens, cache| compiled.forward(tokens, cache));
            for (step, (a, b)) in graph.iter().zip(&eager).enumerate() {
                assert_eq!(bits(a), bits(b), "{label} step {step}: compiled and eager bits");
            }
            // The eager context and candle-native ops run the same kernels on the same values.
            let registry = vllm_ir::registry().unwrap();
            let ours = run(&model, Ops::Ours(&registry), &prompt, 3);
            for (step, (a, b)) in graph.iter().zip(&ours).enumerate() {
                assert_eq!(bits(a), bits(b), "{label} step {step}: compiled and candle-native bits");
            }

            let stats = compiled.stats();
            assert_eq!(stats.graphs, 2, "{label}: one prefill graph and one decode graph for every step");
            assert!(stats.copies_inserted > 0, "{label}: lowering copies the in-place kernels' inputs");
            assert_eq!((stats.copies_left, stats.copies_run), (0, 0), "{label}: no copy survives or runs");
            let calls =
                |op: &str, provider: &str| stats.providers.get(&(op.to_owned(), provider)).copied().unwrap_or(0);
            let (layers, steps) = (config.num_hidden_layers, 4);
            assert_eq!(calls("llama_linear", "engine"), (4 * layers + 1) * steps, "{label}");
            assert_eq!(calls("llama_attention", "engine"), layers * steps, "{label}");
            if config.has_qk_norm() {
                // Traced unfused (the heads of q and of k normalized, then rotary), found by
                // fuse-row-programs, and split in two on the qkv storage: each call normalizes and
                // rotates its slice of qkv where it is.
                assert_eq!(calls("fused_qk_norm_rope", "cpu"), 2 * layers * steps, "{label}");
                assert_eq!(calls("rotary_embedding", "cpu"), 0, "{label}: every rotation fused");
                let text = compiled.graph(24).unwrap().to_string();
                assert!(text.contains("impl fused_qk_norm_rope[cpu] writes(1)"), "{text}");
            } else {
                assert_eq!(
                    calls("rotary_embedding", "cpu"),
                    2 * layers * steps,
                    "{label}: q and k split on one storage"
                );
            }
            if config.is_gemma3() {
                // Traced unfused (norm, add, norm), found by fuse-row-programs: the sandwich around
                // the attention, and the one from the MLP's output into the next layer's (or the
                // final) norm.
                assert_eq!(calls("fused_sandwich_rms_norm", "cpu"), 2 * layers * steps, "{label}");
                let text = compiled.graph(24).unwrap().to_string();
                assert!(text.contains("impl fused_sandwich_rms_norm[cpu] writes(0, 1)"), "{text}");
            }
            assert!(
                stats.providers.keys().all(|(_, provider)| *provider != "native"),
                "{label}: {:?}",
                stats.providers
            );
            let text = compiled.graph(1).unwrap().to_string();
            assert!(text.contains("impl llama_attention[engine] (") && text.contains("%layers.0.qkv: f32["), "{text}");
        }
    }
}

#[test]
fn engine_weights_cross_into_the_graph_and_back_without_a_copy() {
    let config = model::tiny_config("llama");
    let model = Model::new(config.clone(), &model::random_weights(&config, DType::F32, 2).unwrap()).unwrap();
    let weights = compiled::Weights::of(&model).unwrap();
    let (name, qkv) = &weights.layers[0][1];
    assert_eq!(name, "layers.0.qkv");
    assert_eq!(qkv.to_candle().unwrap().id(), model.layers[0].qkv.weight().id(), "the candle weight itself");
}

#[test]
fn attention_outside_its_engine_is_a_clear_error() {
    let config = model::tiny_config("llama");
    let model = Model::new(config.clone(), &model::random_weights(&config, DType::F32, 2).unwrap()).unwrap();
    let compiled = compiled::Compiled::new(&model).unwrap();
    let q = vllm_ir::Tensor::zeros(vllm_ir::DType::F32, &[1, 128]).unwrap();
    let k = vllm_ir::Tensor::zeros(vllm_ir::DType::F32, &[1, 64]).unwrap();
    // No forward in flight: the provider has no cache to attend over.
    let err = compiled::attention::llama_attention(compiled.registry(), &q, &k, &k, 0).unwrap_err().to_string();
    assert!(err.contains("no KV cache is installed"), "{err}");
    // Without the engine's provider, native says where the op runs.
    let builder = vllm_ir::RegistryBuilder::new().unwrap();
    builder.registry().define_op(&compiled::attention::LLAMA_ATTENTION).unwrap();
    let registry = builder.build().unwrap();
    let err = compiled::attention::llama_attention(&registry, &q, &k, &k, 0).unwrap_err().to_string();
    assert!(err.contains("only its `engine` provider runs it"), "{err}");
}

#[test]
fn ours_and_candle_nn_agree_with_no_copy_and_no_fallback() {
    let registry = vllm_ir::registry().unwrap();
    for variant in VARIANTS {
        for (dtype, tolerance) in [(DType::F32, 1e-4f32), (DType::BF16, 3e-2)] {
            let label = format!("{variant} {dtype:?}");
            let config = model::tiny_config(variant);
            let mut model =
                Model::new(config, &model::random_weights(&model::tiny_config(variant), dtype, 3).unwrap()).unwrap();
            let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 256).collect();
            let before = registry.selection_record();
            let ours = run(&model, Ops::Ours(&registry), &prompt, 3);
            let step = registry.selection_record().since(&before);
            let reference = run(&model, Ops::CandleNn, &prompt, 3);
            for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
                let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
                let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1.0);
                let diff = (&a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(diff <= tolerance * scale, "{label} step {i}: max |diff| {diff} (logits up to {scale})");
                if dtype == DType::F32 {
                    let argmax = |t: &Tensor| t.argmax(1).unwrap().to_vec1::<u32>().unwrap();
                    assert_eq!(argmax(&a), argmax(&b), "{label} step {i}: greedy tokens");
                }
            }
            assert_eq!((step.defensive_copies(), step.native_fallbacks()), (0, 0), "{label}");
            // Per layer: two fused norms (one the first layer's plain norm), rotary on q and k.
            let layers: u64 = 2;
            let calls: u64 = 4; // prefill and three decode steps
            // Gemma 3's fused norms are the sandwiches (norm, add, norm): one fused op.
            let fused_op = if variant == "gemma3_text" { "fused_sandwich_rms_norm" } else { "fused_add_rms_norm" };
            let fused = step.op(fused_op).unwrap();
            assert_eq!(fused.inplace_writes, 2 * (2 * layers) * calls, "{label}: x and residual in place");
            // Qwen3 and Gemma 3 normalize and rotate each head of q and k with one op (a call per
            // slice of qkv), the others rotate both with one rotary call.
            let rotation =
                if model::tiny_config(variant).has_qk_norm() { "fused_qk_norm_rope" } else { "rotary_embedding" };
            let rotary = step.op(rotation).unwrap();
            assert_eq!(rotary.inplace_writes, 2 * layers * calls, "{label}: q and k in place");
            let activation = if variant.starts_with("gemma") { "gelu_and_mul" } else { "silu_and_mul" };
            assert_eq!(step.selections(activation, "cpu"), layers * calls, "{label}");

            // PyTorch's rounding (the norm of the rounded sum, rounded rotary products): still in
            // place with no copy or fallback, within tolerance, and other bits than the default's
            // on bf16 (the same on f32).
            model.set_rounding(vllm_ir::op::Rounding::Dtype);
            let before = registry.selection_record();
            let parity = run(&model, Ops::Ours(&registry), &prompt, 3);
            let step = registry.selection_record().since(&before);
            model.set_rounding(vllm_ir::op::Rounding::Exact);
            assert_eq!((step.defensive_copies(), step.native_fallbacks()), (0, 0), "{label} dtype rounding");
            let max_diff = |a: &Tensor, b: &Tensor| {
                let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
                (&a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
            };
            let from_default: f32 = parity.iter().zip(&ours).map(|(a, b)| max_diff(a, b)).fold(0.0, f32::max);
            assert_eq!(from_default > 0.0, dtype == DType::BF16, "{label}: dtype rounding changes bf16 only");
            for (i, (a, b)) in parity.iter().zip(&reference).enumerate() {
                let scale =
                    b.to_dtype(DType::F32).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let diff = max_diff(a, b);
                assert!(diff <= tolerance * scale.max(1.0), "{label} dtype rounding step {i}: max |diff| {diff}");
            }
        }
    }
}

#[test]
fn a_checkpoint_config_reads_like_hugging_faces() {
    let text = r#"{"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "model_type": "llama", "torch_dtype": "bfloat16"}"#;
    let config: model::Config = serde_json::from_str(text).unwrap();
    assert_eq!((config.kv_heads(), config.head_size(), config.is_gemma()), (8, 128, false));
    let gemma: model::Config = serde_json::from_str(
        r#"{"vocab_size": 256000, "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "model_type": "gemma"}"#,
    )
    .unwrap();
    assert_eq!((gemma.head_size(), gemma.is_gemma()), (256, true));
    // Gemma 3 1B's attention: every sixth layer global, the others sliding over 512 keys.
    let gemma3: model::Config = serde_json::from_str(
        r#"{"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "model_type": "gemma3_text",
            "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}"#,
    )
    .unwrap();
    assert!(gemma3.is_gemma3() && gemma3.has_qk_norm());
    assert_eq!((gemma3.window(0), gemma3.window(5), gemma3.window(6)), (Some(512), None, Some(512)));
    assert_eq!(gemma3.attention_scale(), 1.0 / 16.0);
    let mut gemma2 = model::tiny_config("gemma");
    gemma2.model_type = "gemma2".to_owned();
    let weights = model::random_weights(&gemma2, DType::F32, 1).unwrap();
    let err = Model::new(gemma2, &weights).err().unwrap().to_string();
    assert!(err.contains("gemma2") && err.contains("soft-capping"), "{err}");
    // Llama 3.1's rope scaling, read and used: the model runs on the stretched frequencies.
    let mut config = model::tiny_config("llama");
    config.rope_scaling = Some(
        serde_json::from_str(
            r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}"#,
        )
        .unwrap(),
    );
    assert!(matches!(config.scaling().unwrap(), Some(vllm_ir::layers::RopeScaling::Llama3 { .. })));
    let weights = model::random_weights(&config, DType::F32, 5).unwrap();
    let scaled = Model::new(config, &weights).unwrap();
    let plain = Model::new(model::tiny_config("llama"), &weights).unwrap();
    let registry = vllm_ir::registry().unwrap();
    let prompt: Vec<u32> = (0..80).map(|i| i % 256).collect();
    let (a, b) = (run(&scaled, Ops::Ours(&registry), &prompt, 0), run(&plain, Ops::Ours(&registry), &prompt, 0));
    let diff = (&a[0] - &b[0]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff > 0.0, "the scaled frequencies change the logits");
    let reference = run(&scaled, Ops::CandleNn, &prompt, 0);
    let diff = (&a[0] - &reference[0]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff < 1e-3, "candle-nn on the same scaled cache agrees: {diff}");
    let mut bad = model::tiny_config("llama");
    bad.rope_scaling = Some(serde_json::from_str(r#"{"type": "longrope", "factor": 2.0}"#).unwrap());
    let err = Model::new(bad, &weights).err().unwrap();
    assert!(err.to_string().contains("longrope"), "{err}");
}

/// The logits of Hugging Face transformers' `LlamaForCausalLM`, `GemmaForCausalLM`,
/// `Qwen3ForCausalLM` and `Gemma3ForCausalLM` on the tiny
/// random checkpoints, checked in by `crates/vllm-ir/examples/llama/reference/generate.py` (which
/// makes the same weights): the example's model, prefill then decode, with this project's ops on
/// candle tensors and compiled, gives them within f32 noise and the same greedy tokens.
#[test]
fn the_tiny_models_match_transformers_reference_logits() {
    let registry = vllm_ir::registry().unwrap();
    for variant in VARIANTS {
        let path = format!("{}/../crates/vllm-ir/examples/llama/reference/{variant}.json", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
        // The script's configuration is the example's: a change to one side shows here.
        let config = model::tiny_config(variant);
        let theirs: model::Config = serde_json::from_value(reference["config"].clone()).unwrap();
        assert_eq!(format!("{theirs:?}"), format!("{config:?}"), "{variant}: the script's tiny_config");
        let seed = reference["seed"].as_u64().unwrap();
        let tokens: Vec<u32> = serde_json::from_value(reference["tokens"].clone()).unwrap();
        let expected: Vec<Vec<f32>> = serde_json::from_value(reference["logits"].clone()).unwrap();
        let model = Model::new(config.clone(), &model::random_weights(&config, DType::F32, seed).unwrap()).unwrap();

        let (prompt, rest) = tokens.split_at(16);
        let mut compiled = compiled::Compiled::new(&model).unwrap();
        let paths: [(&str, Box<Forward<'_>>); 2] = [
            ("ours", Box::new(|t: &[u32], c: &mut Cache| model.forward(Ops::Ours(&registry), t, c))),
            ("compiled", Box::new(|t: &[u32], c: &mut Cache| compiled.forward(t, c))),
        ];
        for (name, mut forward) in paths {
            let mut cache = Cache::new(&model);
            let mut rows: Vec<Vec<f32>> = forward(prompt, &mut cache).unwrap().to_vec2().unwrap();
            for &token in rest {
                rows.extend(forward(&[token], &mut cache).unwrap().to_vec2::<f32>().unwrap());
            }
            assert_eq!(rows.len(), expected.len(), "{variant} {name}");
            let scale = expected.iter().flatten().fold(1f32, |m, v| m.max(v.abs()));
            for (position, (ours, theirs)) in rows.iter().zip(&expected).enumerate() {
                let diff = ours.iter().zip(theirs).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    diff <= 4e-6 * scale,
                    "{variant} {name} position {position}: max |diff| {diff} (logits up to {scale})"
                );
                let argmax = |row: &[f32]| row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
                assert_eq!(argmax(ours), argmax(theirs), "{variant} {name} position {position}: greedy token");
            }
        }
    }
}
