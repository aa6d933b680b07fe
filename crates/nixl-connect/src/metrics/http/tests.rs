use super::accepts_openmetrics;

#[test]
fn metrics_http_accept_honours_q_values() {
    assert!(accepts_openmetrics(
        "application/openmetrics-text;version=1.0.0;q=0.75"
    ));
    assert!(accepts_openmetrics(" application/openmetrics-text"));
    assert!(!accepts_openmetrics("application/openmetrics-text;q=0"));
    assert!(!accepts_openmetrics("text/plain;version=0.0.4;q=0.5"));
}
