//! The fp8 conversion the quantization and conversion kernels call (`fp8_e4m3`, `fp8_e5m2` in
//! `kernels/gpu/fp8.h`) is the hardware's `cvt.rn.satfinite` on sm_89 and later and software before.
//! NVRTC compiles each form where it belongs (checked without a GPU); on a device of compute
//! capability 8.9 or later, a kernel converts every one of the 2³² f32 bit patterns both ways and
//! counts the codes that differ, which must be none (elsewhere the test says it was skipped).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use ir_core::Availability;

/// Converts every f32 bit pattern with the kernels' conversion and with the software one, for
/// `format` 0 (e4m3) or 1 (e5m2): counts the patterns whose codes differ and keeps the first.
const COMPARE: &str = r#"
extern "C" __global__ void fp8_compare(unsigned long long* mismatches, unsigned int* first, int format) {
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += step) {
        float f = __uint_as_float((unsigned int)i);
        unsigned char used = format == 0 ? fp8_e4m3(f) : fp8_e5m2(f);
        unsigned char software = format == 0 ? fp8_from_f32(f, 3, 7, 448.0f) : fp8_from_f32(f, 2, 15, 57344.0f);
        if (used != software && atomicAdd(mismatches, 1ull) == 0) *first = (unsigned int)i;
    }
}
"#;

fn ptx(arch: &'static str) -> String {
    let source = format!("{}\n{}\n{COMPARE}", kernels_cuda::PORT, kernels_cuda::quant::FP8);
    let options = CompileOptions { arch: Some(arch), ..Default::default() };
    compile_ptx_with_opts(source, options).unwrap_or_else(|e| panic!("compiling for {arch}: {e:?}")).to_src()
}

#[test]
fn the_hardware_fp8_conversion_is_compiled_from_sm_89_and_gives_the_software_bits() {
    if let Availability::Unavailable(reason) = kernels_cuda::nvrtc_availability() {
        ir_core::testing::skip("nvrtc", &reason);
        return;
    }
    for arch in ["compute_89", "compute_90"] {
        let text = ptx(arch);
        for format in ["e4m3x2", "e5m2x2"] {
            assert!(text.contains(&format!("cvt.rn.satfinite.{format}.f32")), "{arch} lacks the {format} cvt");
        }
    }
    assert!(!ptx("compute_80").contains("cvt.rn.satfinite"), "sm_80 has no fp8 cvt: the software form");

    let devices = match kernels_cuda::devices() {
        Ok(devices) => devices,
        Err(reason) => {
            ir_core::testing::skip("cuda", &format!("the hardware fp8 conversion was compiled, not run: {reason}"));
            return;
        }
    };
    let device = &devices[0];
    let (major, minor) = device.context().compute_capability().unwrap();
    if (major, minor) < (8, 9) {
        let reason = format!("{} has compute capability {major}.{minor}, without an fp8 cvt", device.describe());
        ir_core::testing::skip("cuda", &reason);
        return;
    }
    let arch = kernels_cuda::arch_for(major, minor).expect("a known architecture");
    let module = device.context().load_module(cudarc::nvrtc::Ptx::from_src(ptx(arch))).unwrap();
    let function = module.load_function("fp8_compare").unwrap();
    let stream = device.stream();
    for (format, name) in [(0i32, "f8e4m3fn"), (1, "f8e5m2")] {
        let mut mismatches = stream.alloc_zeros::<u64>(1).unwrap();
        let mut first = stream.alloc_zeros::<u32>(1).unwrap();
        let config = LaunchConfig { grid_dim: (4096, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut launch = stream.launch_builder(&function);
        launch.arg(&mut mismatches).arg(&mut first).arg(&format);
        // SAFETY: the arguments follow `fp8_compare`'s prototype; both buffers hold one element,
        // the only one the kernel writes.
        unsafe { launch.launch(config) }.unwrap();
        let count = stream.clone_dtoh(&mismatches).unwrap()[0];
        let pattern = stream.clone_dtoh(&first).unwrap()[0];
        assert_eq!(count, 0, "{name}: {count} f32 patterns convert differently, the first {pattern:#010x}");
    }
}
