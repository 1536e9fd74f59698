//! Finds the C++ compiler the emulated GPU (feature `emu`) builds its programs with: the one the
//! `cc` crate picks for the target (`CXX` overrides it), passed to the crate as
//! `VLLM_IR_EMU_CXX` (empty when there is none, which the emulator reports when asked to build).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "emu")]
    {
        println!("cargo:rerun-if-env-changed=CXX");
        let compiler = cc::Build::new().cpp(true).cargo_metadata(false).try_get_compiler();
        let path = compiler.map(|c| c.path().display().to_string()).unwrap_or_default();
        println!("cargo:rustc-env=VLLM_IR_EMU_CXX={path}");
    }
}
