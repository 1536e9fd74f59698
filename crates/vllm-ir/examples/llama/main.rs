//! A Llama-architecture model on candle with this project's ops, beside the same model on
//! candle-nn's ops: prefill and decode, the providers each op ran on with their defensive copies
//! and native fallbacks (0 and 0 on the cpu platform), the largest logit difference between the two
//! op sets, and the forward times, interleaved in one run. Then the same model traced and compiled
//! with candle's matmuls and attention as engine ops in the graph (`compiled.rs`): the copies the
//! passes inserted and left, the provider of every node, and whether its logits are the eager
//! run's bit for bit (the example fails otherwise), timed beside the other two.
//!
//! ```text
//! cargo run --release -p vllm-ir --features candle --example llama -- [--model DIR] [--variant llama|gemma|qwen3|gemma3_text]
//!     [--dtype f32|bf16] [--prefill N] [--decode N] [--iters N] [--rounding exact|dtype]
//! ```
//!
//! `--rounding dtype` makes this project's fused norm normalize the sum rounded to the dtype and
//! rotary round its products, as PyTorch (and candle's own bf16 arithmetic) do, for parity checks.
//!
//! `--model` reads a Hugging Face checkpoint directory (`config.json` and `*.safetensors`); without
//! it a tiny random model of `--variant` runs (no download).

#![allow(clippy::print_stdout)]

mod compiled;
mod model;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use candle_core::{DType, Device, Tensor};
use model::{Cache, Model, Ops};

struct Args {
    model: Option<std::path::PathBuf>,
    variant: String,
    dtype: DType,
    prefill: usize,
    decode: usize,
    iters: usize,
    rounding: vllm_ir::op::Rounding,
}

fn args() -> anyhow::Result<Args> {
    let mut args = Args {
        model: None,
        variant: "llama".to_owned(),
        dtype: DType::F32,
        prefill: 64,
        decode: 4,
        iters: 3,
        rounding: vllm_ir::op::Rounding::Exact,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = Some(value()?.into()),
            "--variant" => args.variant = value()?,
            "--dtype" => {
                args.dtype = match value()?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    other => bail!("--dtype {other}: f32 or bf16"),
                }
            }
            "--prefill" => args.prefill = value()?.parse()?,
            "--decode" => args.decode = value()?.parse()?,
            "--iters" => args.iters = value()?.parse()?,
            "--rounding" => {
                use vllm_ir::op::StrEnum;
                let name = value()?;
                args.rounding = vllm_ir::op::Rounding::from_str(&name)
                    .with_context(|| format!("--rounding {name}: exact or dtype"))?;
            }
            other => bail!("unknown argument `{other}` (see the example's documentation)"),
        }
    }
    Ok(args)
}

fn load(args: &Args) -> anyhow::Result<Model> {
    let Some(dir) = &args.model else {
        let config = model::tiny_config(&args.variant);
        let weights = model::random_weights(&config, args.dtype, 7)?;
        return Model::new(config, &weights);
    };
    let text = std::fs::read_to_string(dir.join("config.json")).context("reading config.json")?;
    let config: model::Config = serde_json::from_str(&text).context("parsing config.json")?;
    let mut weights = HashMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            for (name, tensor) in candle_core::safetensors::load(&path, &Device::Cpu)? {
                weights.insert(name, tensor.to_dtype(args.dtype)?);
            }
        }
    }
    Model::new(config, &weights)
}

/// Prefill then `decode` steps through `forward`; the logits of every step, and the time of each
/// phase.
fn generate(
    model: &Model,
    prompt: &[u32],
    decode: usize,
    mut forward: impl FnMut(&[u32], &mut Cache) -> anyhow::Result<Tensor>,
) -> anyhow::Result<(Vec<Tensor>, [Duration; 2])> {
    let mut cache = Cache::new(model);
    let start = Instant::now();
    let mut logits = vec![forward(prompt, &mut cache)?];
    let prefill = start.elapsed();
    let start = Instant::now();
    for _ in 0..decode {
        let last = logits.last().expect("prefill ran");
        let next = last.get(last.dim(0)? - 1)?.argmax(0)?.to_scalar::<u32>()?;
        logits.push(forward(&[next], &mut cache)?);
    }
    Ok((logits, [prefill, start.elapsed()]))
}

/// How the greedy tokens of two runs of one model agree, step by step (each step's logits are
/// `[positions, vocab]`): a position whose argmax differs is a near tie when the reference's margin
/// between the two tokens is within twice the runs' largest logit difference on that position
/// (rounding noise can swap them), and a disagreement otherwise. After a near tie at a step's
/// last position the runs decode different tokens, so later steps are not compared.
struct Agreement {
    /// The largest `|ours - reference|` over the compared steps.
    max_diff: f32,
    /// Steps compared.
    steps: usize,
    /// `(step, position, margin, difference)` of each near tie.
    near_ties: Vec<(usize, usize, f32, f32)>,
}

impl std::fmt::Display for Agreement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.near_ties.is_empty() {
            return write!(f, "greedy tokens identical: true ({} steps)", self.steps);
        }
        write!(f, "greedy tokens agree but for {} near tie(s)", self.near_ties.len())?;
        for (step, position, margin, difference) in &self.near_ties {
            write!(f, "; step {step} position {position}: margin {margin:.3e} <= 2 x difference {difference:.3e}")?;
        }
        write!(f, " ({} steps compared)", self.steps)
    }
}

/// The [`Agreement`] of `ours` with `reference`; a differing token that is no near tie is an error.
fn greedy_agreement(ours: &[Tensor], reference: &[Tensor]) -> anyhow::Result<Agreement> {
    let argmax = |row: &[f32]| row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best });
    let mut agreement = Agreement { max_diff: 0.0, steps: 0, near_ties: Vec::new() };
    for (step, (a, b)) in ours.iter().zip(reference).enumerate() {
        let (a, b) = (a.to_dtype(DType::F32)?.to_vec2::<f32>()?, b.to_dtype(DType::F32)?.to_vec2::<f32>()?);
        agreement.steps += 1;
        let mut diverged = false;
        for (position, (row_a, row_b)) in a.iter().zip(&b).enumerate() {
            let difference = row_a.iter().zip(row_b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            agreement.max_diff = agreement.max_diff.max(difference);
            let (token_a, token_b) = (argmax(row_a), argmax(row_b));
            if token_a == token_b {
                continue;
            }
            let margin = row_b[token_b] - row_b[token_a];
            if margin > 2.0 * difference {
                anyhow::bail!(
                    "greedy tokens differ at step {step} position {position}: ours {token_a}, candle-nn {token_b}, \
                     with a margin of {margin:.3e} in candle-nn's logits, more than twice the runs' difference \
                     {difference:.3e}"
                );
            }
            agreement.near_ties.push((step, position, margin, difference));
            diverged |= position + 1 == a.len();
        }
        if diverged {
            break;
        }
    }
    Ok(agreement)
}

/// The largest `|a - b|` over every step's logits, and whether every step's bits are equal.
fn compare(a: &[Tensor], b: &[Tensor]) -> anyhow::Result<(f32, bool)> {
    let (mut max_diff, mut identical) = (0f32, true);
    for (a, b) in a.iter().zip(b) {
        let (a, b) = (
            a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        );
        for (x, y) in a.iter().zip(&b) {
            max_diff = max_diff.max((x - y).abs());
            identical &= x.to_bits() == y.to_bits();
        }
    }
    Ok((max_diff, identical))
}

fn main() -> anyhow::Result<()> {
    let args = args()?;
    let mut model = load(&args)?;
    model.set_rounding(args.rounding);
    let c = model.config();
    println!(
        "{} model: {} layers, hidden {}, {} heads ({} kv), head size {}, {:?}, rounding {}",
        c.model_type,
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.kv_heads(),
        c.head_size(),
        args.dtype,
        vllm_ir::op::StrEnum::as_str(args.rounding)
    );
    // Frozen: every op and provider is registered; nothing registers later.
    let registry = vllm_ir::registry()?;
    let prompt: Vec<u32> = (0..args.prefill as u32).map(|i| (i * 31 + 7) % c.vocab_size as u32).collect();

    // One run each, the record taken around ours.
    let ours_forward = |tokens: &[u32], cache: &mut Cache| model.forward(Ops::Ours(&registry), tokens, cache);
    let nn_forward = |tokens: &[u32], cache: &mut Cache| model.forward(Ops::CandleNn, tokens, cache);
    let before = registry.selection_record();
    let (ours, _) = generate(&model, &prompt, args.decode, ours_forward)?;
    let step = registry.selection_record().since(&before);
    let (reference, _) = generate(&model, &prompt, args.decode, nn_forward)?;
    print!("{step}");
    let agreement = greedy_agreement(&ours, &reference)?;
    println!("logits: max |ours - candle-nn| {:.3e}; {agreement}", agreement.max_diff);

    // The same model traced and compiled, candle's matmuls and attention as engine ops.
    let mut compiled = compiled::Compiled::new(&model)?;
    let (eager, _) = generate(&model, &prompt, args.decode, |tokens, cache| compiled.forward_eager(tokens, cache))?;
    let (graph, _) = generate(&model, &prompt, args.decode, |tokens, cache| compiled.forward(tokens, cache))?;
    let stats = compiled.stats().clone();
    let (_, bit_exact) = compare(&graph, &eager)?;
    let (from_ours, _) = compare(&graph, &ours)?;
    println!(
        "compiled: {} graph(s); copies: {} inserted by lowering, {} left after clone elimination, {} made in runs",
        stats.graphs, stats.copies_inserted, stats.copies_left, stats.copies_run
    );
    let mut providers: Vec<_> = stats.providers.iter().collect();
    providers.sort();
    for ((op, provider), calls) in providers {
        println!("  {op}: {provider} x{calls}");
    }
    println!("compiled logits bit-identical to eager: {bit_exact}; max |compiled - ours on candle| {from_ours:.3e}");

    // Interleaved timing.
    let mut times = [[Duration::ZERO; 2]; 3];
    for _ in 0..args.iters {
        let runs = [
            generate(&model, &prompt, args.decode, ours_forward)?.1,
            generate(&model, &prompt, args.decode, nn_forward)?.1,
            generate(&model, &prompt, args.decode, |tokens, cache| compiled.forward(tokens, cache))?.1,
        ];
        for (slot, [prefill, decode]) in times.iter_mut().zip(runs) {
            slot[0] += prefill;
            slot[1] += decode;
        }
    }
    let per = |d: Duration, n: usize| d.as_secs_f64() * 1e3 / n.max(1) as f64;
    for (name, [prefill, decode]) in ["ours", "candle-nn", "compiled"].into_iter().zip(times) {
        println!(
            "{name:<10} prefill {} tokens {:>9.3} ms, decode {:>8.3} ms/token",
            args.prefill,
            per(prefill, args.iters),
            per(decode, args.iters * args.decode)
        );
    }
    if step.defensive_copies() != 0 || step.native_fallbacks() != 0 {
        bail!(
            "{} defensive copies and {} native fallbacks (expected 0 and 0)",
            step.defensive_copies(),
            step.native_fallbacks()
        );
    }
    if !bit_exact {
        bail!("the compiled graph's logits differ from the eager run's");
    }
    Ok(())
}
