//! The rotary frequencies of every scaling type against Hugging Face transformers'
//! `ROPE_INIT_FUNCTIONS` on real checkpoints' configurations (Llama 2, Llama 3.1 and 3.2, Qwen2.5
//! YaRN, DeepSeek-V2-Lite and V3, gpt-oss, and the YaRN attention-factor rules): every inverse
//! frequency and the attention factor within 1e-6 relative. The references are checked in
//! (`rope/reference.json`, written by `rope/generate.py`), so no Python runs here.

use layers::{RopeScaling, inverse_frequencies};

#[test]
fn every_rope_type_matches_transformers_on_real_configurations() {
    let text = include_str!("rope/reference.json");
    let reference: serde_json::Value = serde_json::from_str(text).expect("reference.json parses");
    let cases = reference["cases"].as_array().expect("a list of cases");
    assert!(cases.len() >= 10, "the grid: {} cases", cases.len());
    let relative = |ours: f64, theirs: f64| (ours - theirs).abs() / theirs.abs().max(f64::MIN_POSITIVE);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let fields = case["fields"].as_object().unwrap();
        let field = |key: &str| {
            let value = fields.get(key)?;
            value.as_f64().or_else(|| value.as_bool().map(|b| f64::from(u8::from(b))))
        };
        let max_position = case["max_position_embeddings"].as_u64().unwrap() as usize;
        let scaling = RopeScaling::from_hugging_face(case["rope_type"].as_str().unwrap(), field, max_position)
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        let rotary_dim = case["rotary_dim"].as_u64().unwrap() as usize;
        let base = case["rope_theta"].as_f64().unwrap();
        let (ours, attention_factor) = inverse_frequencies(rotary_dim, base, scaling.as_ref()).unwrap();
        let theirs: Vec<f64> = case["inv_freq"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        for (i, (&a, &b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(relative(a, b) <= 1e-6, "{name}: inverse frequency {i}: ours {a}, transformers {b}");
        }
        let expected = case["attention_factor"].as_f64().unwrap();
        assert!(
            relative(attention_factor, expected) <= 1e-6,
            "{name}: attention factor {attention_factor}, transformers {expected}"
        );
    }
}
