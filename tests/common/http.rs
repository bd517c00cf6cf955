//! HTTP requests to nginx in the tests: an agent for which every status is
//! an answer, and a reply with its status, headers and body.

use std::time::Duration;

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(10))).build().into()
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: ureq::http::HeaderMap,
    pub body: String,
}

impl Reply {
    /// The header's value, "" when it is absent.
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }

    /// The header's value, None when it is absent.
    pub fn value(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The header's value as a number; a panic when it is absent.
    pub fn number(&self, name: &str) -> u64 {
        self.num(name).unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers))
    }

    /// The rate-limit headers (RateLimit*, X-RateLimit*, Retry-After), by
    /// name, in a fixed order.
    pub fn limit_headers(&self) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = self
            .headers
            .iter()
            .filter(|(k, _)| {
                let k = k.as_str();
                k.starts_with("ratelimit") || k.starts_with("x-ratelimit") || k == "retry-after"
            })
            .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap().to_string()))
            .collect();
        v.sort();
        v
    }

    /// The header's value as a number, None when it is absent.
    pub fn num(&self, name: &str) -> Option<u64> {
        self.headers.get(name).map(|v| v.to_str().ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{name}: {v:?} is not a number")))
    }
}

/// GET `url` with `headers`; the whole body read.
pub fn get(agent: &ureq::Agent, url: &str, headers: &[(&str, &str)]) -> Reply {
    let mut req = agent.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut r = req.call().unwrap();
    let body = r.body_mut().read_to_string().unwrap_or_default();
    Reply { status: r.status().as_u16(), headers: r.headers().clone(), body }
}

/// GET `url` as tenant `tenant` (the examples' `X-Tenant-Id`).
pub fn get_as(agent: &ureq::Agent, url: &str, tenant: &str) -> Reply {
    get(agent, url, &[("X-Tenant-Id", tenant)])
}
