//! The model study (timed here, interleaved): the Llama example's model, a random checkpoint of
//! each variant (Llama with grouped-query attention, Gemma), with this project's ops on candle
//! tensors and with candle-nn's, prefill of 512 tokens and decode; the share of the forward time
//! spent in this project's ops, and the copies and native fallbacks; and the same model traced and
//! compiled (candle's matmuls and attention as engine ops in the graph). Writes `model.json` for
//! `cargo xtask bench`.

// A benchmark reports on standard output.
#![allow(clippy::print_stdout)]

#[path = "../../vllm-ir/examples/llama/compiled.rs"]
mod compiled;
#[path = "../../vllm-ir/examples/llama/model.rs"]
mod model;

use std::time::{Duration, Instant};

use candle_core::DType;
use model::{Cache, Model, Ops};
use serde::Serialize;

#[derive(Serialize)]
struct Row {
    variant: String,
    dtype: String,
    layers: usize,
    hidden: usize,
    prefill_tokens: usize,
    /// Ours, candle-nn's, compiled.
    prefill_ms: [f64; 3],
    /// Ours, candle-nn's, compiled.
    decode_ms: [f64; 3],
    /// Of ours' forward time, the share inside this project's op calls.
    ours_share: f64,
    copies: u64,
    native_fallbacks: u64,
    /// Copies the compiled graphs run (clones left by the passes and the interpreter's).
    compiled_copies: usize,
}

fn config(variant: &str) -> model::Config {
    let mut config = model::tiny_config(variant);
    (config.hidden_size, config.intermediate_size, config.num_hidden_layers) = (1024, 2816, 4);
    (config.num_attention_heads, config.num_key_value_heads) = (16, Some(4));
    config.head_dim = Some(if variant == "gemma" { 128 } else { 64 });
    config.vocab_size = 4096;
    config
}

/// Prefill, then `decode` steps through `forward`: the time of each phase and the time inside our
/// ops.
fn run(
    model: &Model,
    prompt: &[u32],
    decode: usize,
    mut forward: impl FnMut(&[u32], &mut Cache) -> anyhow::Result<candle_core::Tensor>,
) -> [Duration; 3] {
    model::reset_op_time();
    let mut cache = Cache::new(model);
    let start = Instant::now();
    forward(prompt, &mut cache).expect("prefill");
    let prefill = start.elapsed();
    let start = Instant::now();
    for step in 0..decode {
        forward(&[(step * 7 % 4096) as u32], &mut cache).expect("decode");
    }
    [prefill, start.elapsed(), model::op_time()]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let quick = vllm_ir_bench::output::quick();
    let (prefill_tokens, decode, iters) = if quick { (128, 4, 2) } else { (512, 16, 5) };
    let registry = vllm_ir::registry().expect("the registry");
    let mut rows = Vec::new();
    println!("model: prefill {prefill_tokens}, decode {decode} tokens, {iters} interleaved runs, ours vs candle-nn");
    for variant in ["llama", "gemma"] {
        for dtype in [DType::F32, DType::BF16] {
            let config = config(variant);
            let (layers, hidden) = (config.num_hidden_layers, config.hidden_size);
            let weights = model::random_weights(&config, dtype, 11).expect("weights");
            let model = Model::new(config, &weights).expect("the model");
            let prompt: Vec<u32> = (0..prefill_tokens as u32).map(|i| (i * 31 + 7) % 4096).collect();
            let ours = |tokens: &[u32], cache: &mut Cache| model.forward(Ops::Ours(&registry), tokens, cache);
            let nn = |tokens: &[u32], cache: &mut Cache| model.forward(Ops::CandleNn, tokens, cache);
            let mut compiled = compiled::Compiled::new(&model).expect("the compiled model");
            let before = registry.selection_record();
            run(&model, &prompt, 1, ours);
            let step = registry.selection_record().since(&before);
            // Traces and compiles the prefill and decode graphs before timing.
            run(&model, &prompt, 1, |tokens, cache| compiled.forward(tokens, cache));
            let mut totals = [[Duration::ZERO; 3]; 3];
            for _ in 0..iters {
                let runs = [
                    run(&model, &prompt, decode, ours),
                    run(&model, &prompt, decode, nn),
                    run(&model, &prompt, decode, |tokens, cache| compiled.forward(tokens, cache)),
                ];
                for (slot, times) in totals.iter_mut().zip(runs) {
                    for (total, time) in slot.iter_mut().zip(times) {
                        *total += time;
                    }
                }
            }
            let ms = |d: Duration, n: usize| d.as_secs_f64() * 1e3 / n as f64;
            let row = Row {
                variant: variant.to_owned(),
                dtype: format!("{dtype:?}").to_lowercase(),
                layers,
                hidden,
                prefill_tokens,
                prefill_ms: [0, 1, 2].map(|slot| ms(totals[slot][0], iters)),
                decode_ms: [0, 1, 2].map(|slot| ms(totals[slot][1], iters * decode)),
                ours_share: totals[0][2].as_secs_f64() / (totals[0][0] + totals[0][1]).as_secs_f64(),
                copies: step.defensive_copies(),
                native_fallbacks: step.native_fallbacks(),
                compiled_copies: compiled.stats().copies_run,
            };
            println!(
                "{variant} {}: prefill {:.2} vs {:.2} (compiled {:.2}) ms, decode {:.3} vs {:.3} (compiled {:.3}) \
                 ms/token, ours {:.1}% of the forward, copies {}, fallbacks {}",
                row.dtype,
                row.prefill_ms[0],
                row.prefill_ms[1],
                row.prefill_ms[2],
                row.decode_ms[0],
                row.decode_ms[1],
                row.decode_ms[2],
                100.0 * row.ours_share,
                row.copies,
                row.native_fallbacks
            );
            rows.push(row);
        }
    }
    match vllm_ir_bench::output::write_json("model.json", &rows) {
        Ok(path) => println!("wrote {}", path.display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
