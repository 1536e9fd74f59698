//! Every built-in row program as the OpenCL C kernel `kernel_support::program::opencl_source`
//! generates, launched by the `xpu` provider's runtime on its device (PoCL's CPU device in CI),
//! against the reference interpreter: within each op's tolerance (the kernel sums per work-item
//! and by a tree, computes wide steps in the compute type, and takes exp, tanh and erf from the
//! device's library).

use ir_core::storage::Storage;
use ir_core::{DType, Tensor, UniqueTensor};
use ir_ops::row_program::{InPlaceArg, RowArg, builtin};
use kernel_support::testing::{SampleArg, check_row_program_outputs, row_program_sample};
use kernels_xpu::runtime::OpenCl;

/// A host tensor moved to the xpu device, its layout kept.
fn upload(t: &Tensor) -> Tensor {
    let host = t.deep_clone_same_layout().unwrap();
    let buffer = host.cpu_buffer().unwrap();
    let mut device =
        ir_core::storage::DeviceAllocator::allocate(&kernels_xpu::allocator().unwrap(), buffer.len_bytes()).unwrap();
    device.upload(buffer.bytes()).unwrap();
    Tensor::from_storage(Storage::Device(device), host.dtype(), host.layout().clone()).unwrap()
}

/// The program arguments of `samples`, their tensors taken in order from `tensors`.
fn row_args<'a>(samples: &[SampleArg], tensors: &'a [Tensor]) -> Vec<RowArg<'a>> {
    let mut tensors = tensors.iter();
    samples
        .iter()
        .map(|s| match s {
            SampleArg::Tensor(_) => RowArg::Tensor(tensors.next().unwrap()),
            SampleArg::Scalar(v) => RowArg::Scalar(*v),
        })
        .collect()
}

#[test]
fn every_built_in_program_runs_as_generated_opencl_c() {
    if let ir_core::Availability::Unavailable(reason) = kernels_xpu::availability() {
        ir_core::testing::skip("xpu", &format!("xpu kernels: {reason}"));
        return;
    }
    if !kernels_xpu::kernel_dtypes().contains(DType::F64) {
        ir_core::testing::skip("xpu-fp64", "the OpenCL device has no cl_khr_fp64: generated kernels are refused there");
        return;
    }
    // Each program in one dtype, the dtypes taken in turn (a build per program and dtype).
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    for (index, program) in builtin::all().into_iter().enumerate() {
        let dtype = dtypes[index % dtypes.len()];
        let host = row_program_sample(&program, dtype, 5, 300);
        let device: Vec<SampleArg> = host
            .iter()
            .map(|s| match s {
                SampleArg::Tensor(t) => SampleArg::Tensor(upload(t)),
                SampleArg::Scalar(v) => SampleArg::Scalar(*v),
            })
            .collect();
        let args = |samples: &[SampleArg]| -> Vec<Tensor> {
            samples.iter().filter_map(|s| if let SampleArg::Tensor(t) = s { Some(t.clone()) } else { None }).collect()
        };
        let (host_tensors, device_tensors) = (args(&host), args(&device));
        let ours = kernel_support::gpu::run_row_program::<OpenCl>(&program, &row_args(&device, &device_tensors))
            .unwrap_or_else(|e| panic!("{} {dtype}: {e}", program.name()));
        let reference = program.run(&row_args(&host, &host_tensors)).unwrap();
        for out in &ours {
            assert!(matches!(out.storage(), Storage::Device(_)), "{}: on the device", program.name());
        }
        check_row_program_outputs(&program, dtype, &ours, &reference, "xpu");
        if program.is_inplace() {
            // In place on donated device copies (the x sample is a column slice of a wider
            // buffer): the same kernel arithmetic, so the functional run's bits.
            let mut donated: Vec<Option<UniqueTensor>> = tensors_in_order(&host)
                .into_iter()
                .enumerate()
                .map(|(input, t)| {
                    let written = program.outputs().iter().any(|o| o.in_place_of == Some(input));
                    written.then(|| UniqueTensor::new(upload(&t)).unwrap())
                })
                .collect();
            let fresh = {
                let mut args: Vec<InPlaceArg<'_>> = row_args(&device, &device_tensors)
                    .into_iter()
                    .zip(donated.iter_mut())
                    .map(|(arg, donated)| match donated {
                        Some(unique) => InPlaceArg::Donated(unique),
                        None => InPlaceArg::Read(arg),
                    })
                    .collect();
                kernel_support::gpu::run_row_program_in_place::<OpenCl>(&program, &mut args)
                    .unwrap_or_else(|e| panic!("{} {dtype} in place: {e}", program.name()))
            };
            for (index, (output, fresh)) in program.outputs().iter().zip(fresh).enumerate() {
                let got = match (output.in_place_of, fresh) {
                    (Some(input), None) => donated[input].take().expect("donated").into_tensor(),
                    (None, Some(tensor)) => tensor,
                    other => panic!("{}: output {index}: {:?}", program.name(), other.0),
                };
                assert!(
                    ir_core::bit_eq(&got.to_cpu().unwrap(), &ours[index].to_cpu().unwrap()),
                    "{} {dtype}: in-place output {index} differs from the functional run",
                    program.name()
                );
            }
        }
    }
}

/// Each argument's tensor (an empty one for a scalar), in input order.
fn tensors_in_order(samples: &[SampleArg]) -> Vec<Tensor> {
    samples
        .iter()
        .map(|s| match s {
            SampleArg::Tensor(t) => t.clone(),
            SampleArg::Scalar(_) => Tensor::zeros(DType::F32, &[0]).unwrap(),
        })
        .collect()
}
