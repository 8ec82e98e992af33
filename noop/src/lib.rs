//! A proxy-wasm HTTP filter that does nothing: every request continues untouched. `make bench`
//! runs it in the same Envoy, in front of the same upstream, as the rate-limit filter, so the
//! difference between the two is the cost of rate limiting, not of running Wasm at all.

#[cfg(all(target_arch = "wasm32", target_os = "wasi"))]
mod host {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
    }}

    struct Root;
    impl Context for Root {}
    impl RootContext for Root {
        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Nothing))
        }
        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Nothing;
    impl Context for Nothing {}
    impl HttpContext for Nothing {
        fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
            Action::Continue
        }
    }
}
