use std::time::Duration;

use super::*;

/// A peer found without a same-host path is avoided for `NEGATIVE_TTL`, then asked again;
/// the memory of avoided names never passes `MAX_NEGATIVE`.
#[test]
fn client_book_avoids_a_peer_for_a_while_and_remembers_a_bounded_number() {
    let mut b = ClientBook::default();
    let t0 = Instant::now();
    b.avoid("a".into(), t0, &Decline::of(DeclineReason::OtherUser, "why"));
    assert_eq!(
        b.avoids("a", t0 + NEGATIVE_TTL - Duration::from_millis(1))
            .map(|(w, k)| (&**w, k)),
        Some(("why", DeclineReason::OtherUser)),
        "the reason is remembered with the name, and its kind"
    );
    assert!(b.avoids("a", t0 + NEGATIVE_TTL).is_none());
    assert!(b.avoids("b", t0).is_none());
    for n in 0..MAX_NEGATIVE + 1 {
        b.avoid(format!("p{n}").into(), t0, &"why".into());
    }
    assert!(b.avoided.len() <= MAX_NEGATIVE);
}

/// A closed connection forgets its peer only if it is still the one serving that peer.
#[test]
fn client_book_forgets_only_the_connection_that_closed() {
    let mut b = ClientBook::default();
    b.connected("a".into(), 1);
    b.connected("a".into(), 2);
    b.disconnected("a", 1);
    assert_eq!(b.conn_to("a"), Some(2));
    b.disconnected("a", 2);
    assert_eq!(b.conn_to("a"), None);
}
