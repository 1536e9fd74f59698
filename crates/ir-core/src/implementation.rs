//! What an implementation (provider) of an op is: availability, `supports` predicate, in-place flag
//! and function.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use crate::Tensor;
use crate::op::{ArgMeta, KernelError, Outputs, Value};

/// Whether a provider can run on this machine (library, driver, device), never a user preference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Availability {
    /// It can run.
    Available,
    /// It cannot, and why (`libcuda.so not found`, `built without feature `rocm``).
    Unavailable(String),
}

/// A `supports` predicate's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Support {
    /// The provider handles these arguments.
    Yes,
    /// It does not, and why.
    No(Cow<'static, str>),
}

/// The availability probe: evaluated at most once per registry, lazily; a panic inside it is caught.
pub type Probe = Arc<dyn Fn() -> Availability + Send + Sync>;
/// The `supports` predicate: argument metadata only, pure, independent of the number of tokens.
pub type SupportsFn = Arc<dyn Fn(&[ArgMeta<'_>]) -> Support + Send + Sync>;

/// A provider's registration data, apart from its function.
#[derive(Clone)]
pub struct ImplSpec {
    /// Provider name (`^[a-z_][a-z_0-9]*$`; `native` and `unfused` are reserved). A name made at run
    /// time (an engine's plugin name) is stored once for the life of the process when registered.
    pub provider: std::borrow::Cow<'static, str>,
    /// Availability probe.
    pub probe: Probe,
    /// `None` means "supports all arguments".
    pub supports: Option<SupportsFn>,
    /// Whether this provider, when available, makes its platform the detected one (`None`: yes).
    ///
    /// An OpenCL CPU device (PoCL) can make the `xpu` provider available for tests without ever making
    /// the platform Xpu.
    pub detects_platform: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

impl ImplSpec {
    /// An always-available provider with no predicate. The name may be a literal or a `String`
    /// made at run time.
    pub fn new(provider: impl Into<std::borrow::Cow<'static, str>>) -> ImplSpec {
        ImplSpec {
            provider: provider.into(),
            probe: Arc::new(|| Availability::Available),
            supports: None,
            detects_platform: None,
        }
    }

    /// The same spec with an availability probe.
    pub fn with_probe(self, probe: impl Fn() -> Availability + Send + Sync + 'static) -> ImplSpec {
        ImplSpec { probe: Arc::new(probe), ..self }
    }

    /// The same spec with a check of whether availability should make the platform the detected one.
    pub fn with_platform_detection(self, detects: impl Fn() -> bool + Send + Sync + 'static) -> ImplSpec {
        ImplSpec { detects_platform: Some(Arc::new(detects)), ..self }
    }

    /// The same spec with a `supports` predicate.
    pub fn with_supports(self, supports: impl Fn(&[ArgMeta<'_>]) -> Support + Send + Sync + 'static) -> ImplSpec {
        ImplSpec { supports: Some(Arc::new(supports)), ..self }
    }
}

impl fmt::Debug for ImplSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImplSpec")
            .field("provider", &self.provider)
            .field("supports", &self.supports.is_some())
            .finish()
    }
}

/// A function over bound arguments, what the dynamic constructors store.
type BoundFn = dyn Fn(&mut [Value]) -> Result<Outputs, KernelError> + Send + Sync;

/// A typed function `F` and the plain function that runs it on bound arguments.
struct Stored<F: ?Sized> {
    run: fn(&F, &mut [Value]) -> Result<Outputs, KernelError>,
    func: Box<F>,
}

/// What an implementation stores, its function's type erased: run on bound arguments (tensors an
/// in-place implementation writes are taken out of the list), or read back as the typed function.
pub(crate) trait StoredFn: Send + Sync {
    fn run(&self, args: &mut [Value]) -> Result<Outputs, KernelError>;
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<F: ?Sized + Send + Sync + 'static> StoredFn for Stored<F> {
    fn run(&self, args: &mut [Value]) -> Result<Outputs, KernelError> {
        (self.run)(&self.func, args)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// An implementation function with its in-place flag, stored once: the registry's typed calls run
/// it on the caller's arguments as they are, the dynamic calls (bound arguments) through an adapter
/// that is a plain function, not a second copy.
///
/// Typed constructors live beside each op (its `register` and `Impl`); these dynamic ones serve ops
/// defined at run time, whose argument lists the registry has bound before every call. A function
/// may return its outputs as a `Vec<Tensor>` or as [`Outputs`] (inline, no allocation).
#[derive(Clone)]
pub struct ImplFunc {
    pub(crate) inplace: bool,
    pub(crate) func: Arc<dyn StoredFn>,
}

impl ImplFunc {
    /// A functional implementation over bound arguments; it must not write any argument.
    pub fn functional<O: Into<Outputs>>(
        f: impl Fn(&[Value]) -> Result<O, KernelError> + Send + Sync + 'static,
    ) -> ImplFunc {
        let f: Box<BoundFn> = Box::new(move |args: &mut [Value]| f(args).map(Into::into));
        ImplFunc::typed(false, f, |f, args| f(args))
    }

    /// An in-place implementation: it receives the bound arguments, every activation uniquely owned
    /// (take them out of the list to write them), writes output i into activation i's storage and
    /// returns those tensors.
    pub fn inplace<O: Into<Outputs>>(
        f: impl Fn(&mut [Value]) -> Result<O, KernelError> + Send + Sync + 'static,
    ) -> ImplFunc {
        let f: Box<BoundFn> = Box::new(move |args: &mut [Value]| f(args).map(Into::into));
        ImplFunc::typed(true, f, |f, args| f(args))
    }

    /// An implementation storing `func`, a typed function (for an op's typed calls, the op's typed
    /// `dyn Fn`, over its functional or its in-place argument types), with `run`, the plain
    /// function that runs it on bound arguments. [`define_op!`](crate::define_op)'s `register` and
    /// `Impl` make these; the op's typed calls run the function on the caller's arguments as they
    /// are.
    #[doc(hidden)]
    pub fn typed<F: ?Sized + Send + Sync + 'static>(
        inplace: bool,
        func: Box<F>,
        run: fn(&F, &mut [Value]) -> Result<Outputs, KernelError>,
    ) -> ImplFunc {
        ImplFunc { inplace, func: Arc::new(Stored { run, func }) }
    }

    /// Whether the implementation writes its outputs into its activations.
    pub fn is_inplace(&self) -> bool {
        self.inplace
    }

    /// The stored function as the typed function `F` (an op's typed `dyn Fn`), when it is one.
    #[inline]
    pub(crate) fn typed_as<F: ?Sized + 'static>(&self) -> Option<&F> {
        self.func.as_any().downcast_ref::<Stored<F>>().map(|stored| &*stored.func)
    }

    /// Runs the function on bound arguments.
    #[inline]
    pub(crate) fn run(&self, args: &mut [Value]) -> Result<Outputs, KernelError> {
        self.func.run(args)
    }

    /// Runs the kernel on bound arguments without any of the registry's checks (arguments, the
    /// predicate, the output contract): not a way to run an op, but the function a benchmark
    /// measures against the registry's calls, after it validated the same call once through
    /// [`Registry::run`](crate::Registry::run). An in-place implementation needs every activation
    /// uniquely owned.
    pub fn invoke(&self, mut args: Vec<Value>) -> Result<Vec<Tensor>, KernelError> {
        self.run(&mut args).map(Outputs::into_vec)
    }

    /// As [`ImplFunc::invoke`], on arguments the caller keeps, with no allocation of its own: a
    /// functional kernel leaves them as they are; an in-place one takes its activations out (their
    /// slots hold `none` afterwards).
    pub fn invoke_in(&self, args: &mut [Value]) -> Result<Outputs, KernelError> {
        self.run(args)
    }
}

impl fmt::Debug for ImplFunc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImplFunc").field("inplace", &self.inplace).finish()
    }
}
