//! The stream a caller asks device kernels to launch on: an [`EagerContext`](crate::EagerContext)
//! carrying a stream sets it for the duration of each call, and a device provider reads it back in
//! its own stream type.

/// A caller's stream handle, type-erased: what [`EagerContext::with_stream`](crate::EagerContext::with_stream)
/// carries.
pub type LaunchStream = std::sync::Arc<dyn std::any::Any + Send + Sync>;

thread_local! {
    static LAUNCH_STREAM: std::cell::RefCell<Option<LaunchStream>> = const { std::cell::RefCell::new(None) };
}

/// The stream the current call's caller asked device kernels to launch on, when it is an `S`
/// (a kernel crate asks for its own stream type, e.g. `Arc<CudaStream>`). Set for the duration of
/// each call made through an [`EagerContext`](crate::EagerContext) that carries a stream.
pub fn launch_stream<S: std::any::Any + Clone>() -> Option<S> {
    LAUNCH_STREAM.with(|current| current.borrow().as_ref().and_then(|stream| stream.downcast_ref::<S>().cloned()))
}

/// Runs `f` with `stream` as the launch stream of this thread, restoring the previous one after
/// (also when `f` unwinds).
pub(crate) fn with_launch_stream<R>(stream: Option<&LaunchStream>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<LaunchStream>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            LAUNCH_STREAM.with(|current| *current.borrow_mut() = previous);
        }
    }
    let Some(stream) = stream else { return f() };
    let previous = LAUNCH_STREAM.with(|current| current.borrow_mut().replace(std::sync::Arc::clone(stream)));
    let _restore = Restore(previous);
    f()
}

#[cfg(test)]
mod launch_stream_tests {
    use super::*;

    #[test]
    fn the_launch_stream_is_scoped_to_the_call_and_typed() {
        assert_eq!(launch_stream::<u32>(), None);
        let stream: LaunchStream = std::sync::Arc::new(7u32);
        let seen = with_launch_stream(Some(&stream), || (launch_stream::<u32>(), launch_stream::<String>()));
        assert_eq!(seen, (Some(7), None), "another type is not this provider's stream");
        assert_eq!(launch_stream::<u32>(), None, "restored after the call");
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_launch_stream(Some(&stream), || panic!("a kernel panicked"))
        }));
        assert!(unwound.is_err());
        assert_eq!(launch_stream::<u32>(), None, "restored after an unwind");
    }
}
