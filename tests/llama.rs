//! The Llama example's model, on a tiny random checkpoint of each variant (no download): this
//! project's ops on candle tensors against candle-nn's on the same weights (logits within the
//! dtype's tolerance, the same greedy tokens), with 0 defensive copies and 0 native fallbacks on the
//! cpu platform in prefill and decode, and the in-place ops writing in place.

#[path = "../crates/vllm-ir/examples/llama/model.rs"]
mod model;

use candle_core::{DType, Tensor};
use model::{Cache, Model, Ops};

fn run(model: &Model, ops: Ops<'_>, prompt: &[u32], decode: usize) -> Vec<Tensor> {
    let mut cache = Cache::new(model);
    let mut logits = vec![model.forward(ops, prompt, &mut cache).unwrap()];
    for step in 0..decode {
        let next = (prompt.len() + step * 13) as u32 % model.config().vocab_size as u32;
        logits.push(model.forward(ops, &[next], &mut cache).unwrap());
    }
    logits
}

#[test]
fn ours_and_candle_nn_agree_with_no_copy_and_no_fallback() {
    let registry = vllm_ir::registry().unwrap();
    for variant in ["llama", "gemma"] {
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
            let fused = step.op("fused_add_rms_norm").unwrap();
            assert_eq!(fused.inplace_writes, 2 * (2 * layers) * calls, "{label}: x and residual in place");
            let rotary = step.op("rotary_embedding").unwrap();
            assert_eq!(rotary.inplace_writes, 2 * layers * calls, "{label}: q and k in place");
            let activation = if variant == "gemma" { "gelu_and_mul" } else { "silu_and_mul" };
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
