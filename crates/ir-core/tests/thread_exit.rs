//! A selection held past the end of its thread's dispatch state: a `Dispatch` (public, from
//! `Registry::dispatch`) kept in a thread-local that is destroyed after the registry's
//! per-thread state must still be sound to use and to drop. Small enough to run under Miri, which
//! CI does (`cargo xtask miri`).

use std::cell::RefCell;
use std::sync::OnceLock;

use ir_core::op::{ArgMeta, Overload};
use ir_core::{DType, Dispatch, Registry, Tensor};
use ir_ops::fused_add_rms_norm::FUSED_ADD_RMS_NORM;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry = ir_ops::registry();
        registry.set_default("fused_add_rms_norm", &["native"]).expect("native is registered");
        registry
    })
}

thread_local! {
    /// Registered (first touched) before any dispatch on the thread, so it is destroyed after the
    /// dispatch state that the thread's calls set up.
    static KEPT: RefCell<Option<(Dispatch<'static>, Tensor)>> = const { RefCell::new(None) };
}

#[test]
fn a_selection_kept_in_a_thread_local_outlives_the_threads_dispatch_state() {
    let handle = std::thread::spawn(|| {
        KEPT.with(|kept| assert!(kept.borrow().is_none()));
        let registry = registry();
        let x = Tensor::zeros(DType::F32, &[1, 4]).unwrap();
        let r = Tensor::zeros(DType::F32, &[1, 4]).unwrap();
        let metas =
            [ArgMeta::Tensor(x.meta()), ArgMeta::Tensor(r.meta()), ArgMeta::None, ArgMeta::F64(1e-6), ArgMeta::None];
        // The first selection is made and remembered; the second is lent from the thread's memory.
        drop(registry.dispatch(&FUSED_ADD_RMS_NORM, Overload::MaybeInplace, &metas).unwrap());
        let selected = registry.dispatch(&FUSED_ADD_RMS_NORM, Overload::MaybeInplace, &metas).unwrap();
        let mut activation = x;
        selected.prepare_activation(&mut activation).unwrap();
        KEPT.with(|kept| *kept.borrow_mut() = Some((selected, activation)));
    });
    handle.join().expect("the thread and its thread-locals' destructors run without fault");
    let record = registry().selection_record();
    assert_eq!(record.selections("fused_add_rms_norm", "native"), 2);
    let writes = record.op("fused_add_rms_norm").unwrap().inplace_writes;
    assert_eq!(writes, 1, "the kept selection counted its write when dropped");
}
