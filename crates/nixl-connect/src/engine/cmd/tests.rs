use super::*;

#[test]
fn engine_commands_over_device_memory_stay_on_the_engine_thread() {
    let register = |device| {
        let (reply, _) = oneshot::channel();
        Cmd::Register {
            ranges: vec![
                Range {
                    addr: 4096,
                    len: 4096,
                    device: crate::Device::Host,
                },
                Range {
                    addr: 8192,
                    len: 4096,
                    device,
                },
            ],
            reply,
        }
    };
    assert!(register(crate::Device::Host).host_only());
    assert!(!register(crate::Device::Cuda(0)).host_only());
    assert!(Cmd::Shutdown {
        within: Duration::ZERO
    }
    .host_only());
}
