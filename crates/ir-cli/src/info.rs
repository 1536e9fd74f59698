//! `vllm-ir info`.

use anyhow::Context;
use ir_core::{Availability, Platform};

use crate::{CommonArgs, build_registry};

pub(crate) fn run(args: &CommonArgs) -> anyhow::Result<()> {
    let registry = build_registry()?;
    let config = args.config()?;
    let resolved = config.resolve(&registry).context("resolving priorities")?;
    let how = match config.platform {
        ir_core::PlatformChoice::Detect => "detected",
        ir_core::PlatformChoice::Pinned(_) => "pinned",
    };
    outln!("platform: {} ({how})", resolved.platform);
    outln!("devices:");
    outln!("  cpu: host memory, always available");
    for platform in [Platform::Cuda, Platform::Rocm, Platform::Xpu] {
        let provider = platform.provider();
        let status = registry
            .ops()
            .iter()
            .flat_map(|op| registry.providers(op))
            .find(|p| p.name == provider)
            .map(|p| match p.availability {
                Availability::Available => "available".to_owned(),
                Availability::Unavailable(reason) => format!("unavailable: {reason}"),
            })
            .unwrap_or_else(|| "no provider registered in this build".to_owned());
        outln!("  {platform}: {status}");
    }
    if !config.user.source.is_empty() {
        outln!("user priorities: {}", config.user.source);
    }
    for op in registry.ops() {
        let def = registry.op_def(op).expect("listed ops are defined");
        outln!();
        outln!("op {def}");
        outln!("  {}", def.description);
        for provider in registry.providers(op) {
            let availability = match provider.availability {
                Availability::Available => "available".to_owned(),
                Availability::Unavailable(reason) => format!("unavailable ({reason})"),
            };
            let kind = if provider.inplace { "inplace" } else { "functional" };
            let predicate = if provider.has_predicate { ", has supports predicate" } else { "" };
            outln!("  provider {:<10} {availability}, {kind}{predicate}", provider.name);
        }
        let priority = &resolved.ops[op];
        outln!("  priority: [{}] -> resolved [{}]", priority.merged.join(", "), priority.resolved.join(", "));
    }
    outln!();
    outln!("passes (--passes; the standard pipeline: {}):", ir_passes::Pipeline::standard());
    for def in &ir_passes::PASSES {
        outln!("  {:<24} {}", def.name, def.summary);
    }
    Ok(())
}
