//! A toy decoder built from `layers::RmsNorm` on an engine-style registry with an out-of-tree
//! in-place provider: donated activations are reused, results equal the functional path.

use ir_core::op::InputSpec;
use ir_core::{DType, EagerContext, ExecutionContextExt, Platform, PriorityConfig, Tensor, bit_eq};
use ir_core::{PlatformChoice, UserPriorities};
use ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM;
use layers::RmsNorm;
use vllm_ir_tests::register_inplace_provider;

fn decoder_inputs(tokens: usize, hidden: usize) -> (Tensor, Tensor) {
    let spec = InputSpec { num_tokens: tokens, hidden_size: hidden, dtype: DType::BF16, epsilon: 1e-6, seed: 3 };
    let inputs = (FUSED_ADD_RMS_NORM.generate_inputs)(&spec).unwrap();
    (inputs[0].as_tensor().unwrap().clone(), inputs[1].as_tensor().unwrap().clone())
}

#[test]
fn donated_decoder_steps_reuse_buffers_and_match_the_functional_path() {
    let registry = ir_ops::registry();
    register_inplace_provider(&registry, "engine").unwrap();
    let config = PriorityConfig {
        platform: PlatformChoice::Pinned(Platform::Cpu),
        user: UserPriorities::parse("fused_add_rms_norm=engine").unwrap(),
    };
    let _guard = config.apply_scoped(&registry).unwrap();
    let ctx = EagerContext::new(&registry);
    let norms: Vec<RmsNorm> = (0..3).map(|_| RmsNorm::new(32, DType::BF16).unwrap()).collect();

    let (x0, r0) = decoder_inputs(8, 32);
    let (mut fx, mut fr) = (x0.clone(), r0.clone());
    for norm in &norms {
        let (out, residual) = norm.forward_residual_functional(&ctx, &fx, &fr).unwrap();
        fx = ctx.scale(&out, 0.5).unwrap();
        fr = residual;
    }

    let (mut x, mut residual) = (x0.deep_clone().unwrap(), r0.deep_clone().unwrap());
    drop((x0, r0));
    for norm in &norms {
        let residual_id = residual.storage_id();
        let (out, new_residual) = norm.forward_residual(&ctx, x, residual).unwrap();
        assert_eq!(new_residual.storage_id(), residual_id, "the residual buffer is reused in place");
        x = ctx.scale(&out, 0.5).unwrap();
        residual = new_residual;
    }
    assert!(bit_eq(&x, &fx) && bit_eq(&residual, &fr));
    let record = registry.selection_record();
    assert_eq!(record.selections("fused_add_rms_norm", "engine"), 6);
    let op = record.op("fused_add_rms_norm").unwrap();
    assert_eq!(op.inplace_writes, 6, "three donated calls wrote both activations in place");
    assert_eq!(op.defensive_copies, 6, "three functional calls copied both activations");
}
