//! [`define_op!`](crate::define_op): an op declared once, from one parameter list of Rust marker
//! types (the [`op`](crate::op) module's parameter markers), becomes its definition and the code
//! every audience calls: the typed functional and `maybe_inplace` calls through the registry, the context
//! calls, typed registration and the typed argument view.
//!
//! The macro sits above the registry and the contexts (its expansion names both, in the declaring
//! crate); the op model it builds on (`op`) names neither.

/// Declares an op once; generates its [`OpDef`](crate::op::OpDef) static, the typed functional call, the
/// `maybe_inplace` call (with `inplace: true`), typed registration, a typed argument view for
/// predicates, and the dynamic adapter around the typed native function.
///
/// ```
/// use ir_core::op::{Activation, InputSpec, MetaError, ArgMeta, Value};
/// use ir_core::{KernelError, Tensor, TensorError, TensorMeta};
///
/// ir_core::define_op! {
///     /// `negate(x) -> out`.
///     op negate {
///         def: NEGATE,
///         args: NegateArgs,
///         params: (x: Activation),
///         outputs: Tensor,
///         inplace: false,
///         native: negate_native,
///         meta: |_def, args| Ok(ir_core::op::smallvec![args[0].tensor().unwrap().clone()]),
///         generate: |_spec| Ok(vec![Value::Tensor(Tensor::ones(ir_core::DType::F32, &[2, 4])?)]),
///         tolerances: &[],
///         description: "negation",
///     }
/// }
///
/// fn negate_native(x: &Tensor) -> Result<Tensor, KernelError> {
///     Ok(x.scale(-1.0)?)
/// }
///
/// let registry = ir_core::Registry::new();
/// registry.define_op(&NEGATE)?;
/// let x = Tensor::ones(ir_core::DType::F32, &[2, 4])?;
/// let out = negate(&registry, &x)?;
/// assert_eq!(out.to_f64_vec()?, vec![-1.0; 8]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[macro_export]
macro_rules! define_op {
    (
        $(#[$attr:meta])*
        op $name:ident {
            def: $def:ident,
            args: $args:ident,
            params: ($($(#[$pattr:meta])* $param:ident : $ty:ty $(= $default:expr)?),+ $(,)?),
            outputs: $out:ty,
            inplace: $inplace:tt,
            native: $native:expr,
            meta: $meta:expr,
            generate: $generate:expr,
            tolerances: $tolerances:expr,
            description: $description:expr $(,)?
        }
    ) => {
        $(#[$attr])*
        pub static $def: $crate::op::OpDef = $crate::op::OpDef {
            name: stringify!($name),
            params: &[$($crate::op::ParamDef {
                name: stringify!($param),
                kind: <$ty as $crate::__macro_support::OpParam>::KIND,
                default: $crate::define_op!(@default $($default)?),
            }),+],
            n_outputs: <$out as $crate::__macro_support::OpOutputs>::N,
            activations: $crate::op::Activations::Explicit({
                const NAMES: [&str; [$(stringify!($param)),+].len()] = [$(stringify!($param)),+];
                const DONATED: [bool; NAMES.len()] = [$(<$ty as $crate::__macro_support::OpParam>::DONATED),+];
                const LIST: [&str; $crate::__macro_support::count_donated(DONATED)] = $crate::__macro_support::donated_names(NAMES, DONATED);
                &LIST
            }),
            allow_inplace: $inplace,
            native: {
                fn native_dynamic(
                    args: &[$crate::op::Value],
                ) -> ::std::result::Result<$crate::op::Outputs, $crate::KernelError> {
                    let mut index = 0..;
                    $(let $param = args.get(index.next().expect("unbounded")).and_then(<$ty as $crate::__macro_support::OpParam>::arg)
                        .ok_or_else(|| $crate::op::mismatched(stringify!($name)))?;)+
                    let outputs: $out = ($native)($($param),+)?;
                    Ok(<$out as $crate::__macro_support::OpOutputs>::into_handles(outputs))
                }
                native_dynamic
            },
            meta: $meta,
            generate_inputs: $generate,
            tolerances: $tolerances,
            description: $description,
        };

        #[doc = concat!("Typed view of `", stringify!($name), "`'s argument metadata, for `supports` predicates.")]
        #[derive(Clone, Copy, Debug)]
        pub struct $args<'a> {
            $($(#[$pattr])* #[doc = concat!("`", stringify!($param), "`.")]
            pub $param: <$ty as $crate::__macro_support::OpParam>::Meta<'a>,)+
        }

        impl<'a> $args<'a> {
            /// Reads a bound argument list; `None` when its length or kinds do not match.
            pub fn from_meta(args: &[$crate::op::ArgMeta<'a>]) -> ::std::option::Option<$args<'a>> {
                let mut args = args.iter();
                let view = $args { $($param: <$ty as $crate::__macro_support::OpParam>::meta(args.next()?)?,)+ };
                args.next().is_none().then_some(view)
            }
        }

        $crate::define_op!(@positions $name $args [] $($param)+);
        $crate::define_op!(@functional_call $name $def ($($param : $ty),+) [$out]);
        $crate::define_op!(@ctx_call $name $def Default call CtxArg call_arg ($($param : $ty),+) [$out]
            "functional: inputs never change and outputs never alias them");
        $crate::define_op!(@inplace $inplace $name $def ($($param : $ty),+) $out);
    };

    // The typed signature of a functional implementation of the op, as a trait object.
    (@typed_fn ($($param:ident : $ty:ty),+) [$out:ty]) => {
        dyn for<'a> Fn($(<$ty as $crate::__macro_support::OpParam>::Arg<'a>),+) -> ::std::result::Result<$out, $crate::KernelError>
            + Send + Sync
    };

    // The typed signature of an in-place implementation of the op, as a trait object.
    (@typed_inplace_fn ($($param:ident : $ty:ty),+) [$out:ty]) => {
        dyn for<'a> Fn($(<$ty as $crate::__macro_support::OpParam>::InplaceArg<'a>),+) -> ::std::result::Result<$out, $crate::KernelError>
            + Send + Sync
    };

    (@maybe_inplace_call $name:ident $def:ident ($($param:ident : $ty:ty),+) [$out:ty]) => {
        #[doc = concat!("`", stringify!($name), "` through the registry's installed priorities, `maybe_inplace`: the activations are donated (moved in), so an in-place implementation may write the outputs into their storage when nothing else refers to it.")]
        ///
        /// An implementation registered through this op's `register` runs on the arguments as they
        /// are (a donated activation that something else refers to is copied first); any other goes
        /// through the bound-argument path.
        #[allow(clippy::too_many_arguments)]
        pub fn maybe_inplace(
            registry: &$crate::Registry,
            $($param: <$ty as $crate::__macro_support::OpParam>::Given<'_>),+
        ) -> ::std::result::Result<$out, $crate::CallError> {
            $(#[allow(unused_mut)] let mut $param = $param;)+
            let selected = registry.dispatch(&$def, $crate::op::Overload::MaybeInplace, &[$(<$ty as $crate::__macro_support::OpParam>::given_meta(&$param)),+])?;
            let outputs = if let Some(func) =
                selected.typed_inplace::<$crate::define_op!(@typed_inplace_fn ($($param : $ty),+) [$out])>()
            {
                // Every activation checked before any is copied, then prepared in order.
                let mut index = 0;
                $(if let Some(activation) = <$ty as $crate::__macro_support::OpParam>::given_activation(&mut $param) {
                    selected.check_activation(index, activation)?;
                    index += 1;
                })+
                let _ = index;
                $(if let Some(activation) = <$ty as $crate::__macro_support::OpParam>::given_activation(&mut $param) {
                    selected.prepare_activation(activation)?;
                })+
                let ran: ::std::result::Result<$out, $crate::KernelError> = 'run: {
                    $(let $param = match <$ty as $crate::__macro_support::OpParam>::given_inplace($param) {
                        Ok(arg) => arg,
                        Err(e) => break 'run Err(e.into()),
                    };)+
                    func($($param),+)
                };
                selected.finish(ran)?
            } else if let Some(func) =
                selected.typed_functional::<$crate::define_op!(@typed_fn ($($param : $ty),+) [$out])>()
            {
                selected.finish(func($(<$ty as $crate::__macro_support::OpParam>::given_arg(&$param)),+))?
            } else {
                let mut args = [$(<$ty as $crate::__macro_support::OpParam>::given_value($param)),+];
                <$out as $crate::__macro_support::OpOutputs>::from_outputs(selected.run_bound(&mut args)?)
                    .expect("the registry checks the number of outputs")
            };
            Ok(outputs)
        }
    };

    // Each parameter's position in the argument list, as an associated constant of the view named
    // after the parameter (`RmsNormArgs::weight`), so passes index graph arguments by name.
    (@positions $name:ident $args:ident [$($done:ident)*]) => {};
    (@positions $name:ident $args:ident [$($done:ident)*] $next:ident $($rest:ident)*) => {
        impl $args<'_> {
            #[doc = concat!("The position of `", stringify!($next), "` in `", stringify!($name), "`'s argument list.")]
            #[allow(non_upper_case_globals)]
            pub const $next: usize = 0 $(+ $crate::define_op!(@one $done))*;
        }
        $crate::define_op!(@positions $name $args [$($done)* $next] $($rest)*);
    };
    (@one $done:ident) => {
        1
    };

    (@functional_call $name:ident $def:ident ($($param:ident : $ty:ty),+) [$out:ty]) => {
        #[doc = concat!("`", stringify!($name), "` through the registry's installed priorities, functional: inputs never change and outputs never alias them.")]
        ///
        /// A functional implementation registered through this op's `register` runs on the borrowed
        /// arguments as they are; any other goes through the bound-argument path.
        #[allow(clippy::too_many_arguments)]
        pub fn $name(
            registry: &$crate::Registry,
            $($param: <$ty as $crate::__macro_support::OpParam>::Arg<'_>),+
        ) -> ::std::result::Result<$out, $crate::CallError> {
            let metas = [$(<$ty as $crate::__macro_support::OpParam>::arg_meta($param)),+];
            let dispatch = registry.dispatch(&$def, $crate::op::Overload::Default, &metas)?;
            match dispatch.typed_functional::<$crate::define_op!(@typed_fn ($($param : $ty),+) [$out])>() {
                Some(func) => dispatch.finish(func($($param),+)),
                None => {
                    let mut args = [$(<$ty as $crate::__macro_support::OpParam>::value($param)),+];
                    Ok(<$out as $crate::__macro_support::OpOutputs>::from_outputs(dispatch.run_bound(&mut args)?)
                        .expect("the registry checks the number of outputs"))
                }
            }
        }
    };

    (@ctx_call $name:ident $def:ident $overload:ident $ctx_fname:ident $ctx_given:ident $to_call_arg:ident
        ($($param:ident : $ty:ty),+) [$out:ty] $what:literal) => {
        #[doc = concat!("`", stringify!($name), "` through an execution context (eager, traced, or an engine's own) or another [`OpCaller`](", stringify!($crate), "::OpCaller) (a tensor library's binding), ", $what, ".")]
        #[allow(clippy::too_many_arguments)]
        pub fn $ctx_fname<'a, C: $crate::OpCaller + ?Sized>(
            ctx: &C,
            $($param: <$ty as $crate::__macro_support::OpParam>::$ctx_given<'a, C::Tensor>),+
        ) -> ::std::result::Result<<$out as $crate::__macro_support::OpOutputs>::Of<C::Tensor>, C::Error>
        where
            C::Tensor: 'a,
        {
            let args: $crate::CallArgs<C::Tensor> =
                $crate::op::smallvec![$(<$ty as $crate::__macro_support::OpParam>::$to_call_arg::<C::Tensor>($param)),+];
            let outputs = ctx.call_op(&$def, $crate::op::Overload::$overload, args)?;
            let found = outputs.len();
            <$out as $crate::__macro_support::OpOutputs>::from_handles(outputs)
                .ok_or_else(|| $crate::__macro_support::output_count($def.name, found, <$out as $crate::__macro_support::OpOutputs>::N).into())
        }
    };

    (@default) => { None };
    (@default $default:expr) => { Some($default) };

    (@inplace false $name:ident $def:ident ($($param:ident : $ty:ty),+) $out:ty) => {
        #[doc = concat!("Registers a (functional) implementation of `", stringify!($name), "` from a function or closure with the typed signature.")]
        #[track_caller]
        pub fn register(
            registry: &$crate::Registry,
            spec: $crate::ImplSpec,
            func: impl Fn($(<$ty as $crate::__macro_support::OpParam>::Arg<'_>),+) -> ::std::result::Result<$out, $crate::KernelError>
                + Send + Sync + 'static,
        ) -> ::std::result::Result<(), $crate::RegistryError> {
            registry.register_impl($def.name, spec, $crate::define_op!(@functional $name func ($($param : $ty),+) $out))
        }
    };

    (@inplace true $name:ident $def:ident ($($param:ident : $ty:ty),+) $out:ty) => {
        $crate::define_op!(@maybe_inplace_call $name $def ($($param : $ty),+) [$out]);
        $crate::define_op!(@ctx_call $name $def MaybeInplace call_maybe_inplace CtxGiven given_call_arg
            ($($param : $ty),+) [$out]
            "`maybe_inplace`: the activations are donated (moved in), so an in-place implementation may write the outputs into their storage when nothing else refers to it");

        #[doc = concat!("A typed implementation of `", stringify!($name), "`, functional or in place (a closure: it may capture state).")]
        pub enum Impl {
            /// Writes no argument; returns fresh outputs.
            Functional($crate::ImplFunc),
            /// Writes the outputs into the donated activations (received as `UniqueTensor`s) and returns them.
            Inplace($crate::ImplFunc),
        }

        impl Impl {
            /// A functional implementation from a function or closure.
            pub fn functional(
                func: impl Fn($(<$ty as $crate::__macro_support::OpParam>::Arg<'_>),+) -> ::std::result::Result<$out, $crate::KernelError>
                    + Send + Sync + 'static,
            ) -> Impl {
                Impl::Functional($crate::define_op!(@functional $name func ($($param : $ty),+) $out))
            }

            /// An in-place implementation from a function or closure.
            pub fn inplace(
                func: impl Fn($(<$ty as $crate::__macro_support::OpParam>::InplaceArg<'_>),+) -> ::std::result::Result<$out, $crate::KernelError>
                    + Send + Sync + 'static,
            ) -> Impl {
                type Typed = $crate::define_op!(@typed_inplace_fn ($($param : $ty),+) [$out]);
                // The function is stored once; the bound-argument path runs it through this adapter.
                Impl::Inplace($crate::ImplFunc::typed::<Typed>(true, ::std::boxed::Box::new(func), |func, args| {
                    let mut index = 0..;
                    $(let $param = <$ty as $crate::__macro_support::OpParam>::take(args, index.next().expect("unbounded"))?;)+
                    let mut index = 0..;
                    $(let $param = args.get(index.next().expect("unbounded"))
                        .and_then(|value| <$ty as $crate::__macro_support::OpParam>::inplace_arg($param, value))
                        .ok_or_else(|| $crate::op::mismatched(stringify!($name)))?;)+
                    let outputs: $out = func($($param),+)?;
                    Ok(<$out as $crate::__macro_support::OpOutputs>::into_handles(outputs))
                }))
            }
        }

        #[doc = concat!("Registers an implementation of `", stringify!($name), "`: `Impl::functional(f)` or `Impl::inplace(f)`.")]
        #[track_caller]
        pub fn register(
            registry: &$crate::Registry,
            spec: $crate::ImplSpec,
            func: Impl,
        ) -> ::std::result::Result<(), $crate::RegistryError> {
            let (Impl::Functional(erased) | Impl::Inplace(erased)) = func;
            registry.register_impl($def.name, spec, erased)
        }
    };

    (@functional $name:ident $func:ident ($($param:ident : $ty:ty),+) $out:ty) => {{
        type Typed = $crate::define_op!(@typed_fn ($($param : $ty),+) [$out]);
        // The function is stored once; the bound-argument path runs it through this adapter.
        $crate::ImplFunc::typed::<Typed>(false, ::std::boxed::Box::new($func), |func, args| {
            let mut index = 0..;
            $(let $param = args.get(index.next().expect("unbounded")).and_then(<$ty as $crate::__macro_support::OpParam>::arg)
                .ok_or_else(|| $crate::op::mismatched(stringify!($name)))?;)+
            Ok(<$out as $crate::__macro_support::OpOutputs>::into_handles(func($($param),+)?))
        })
    }};
}
