use super::*;

struct Dummy;
impl Registered for Dummy {
    fn exposed(&self) -> bool {
        false
    }
    fn quarantine(&self, _memory: Hold, _bytes: usize) {}
}

#[test]
fn reg_set_keeps_each_registration_once() {
    let (a, b) = (RegToken::new(Arc::new(Dummy)), RegToken::new(Arc::new(Dummy)));
    let mut set = RegSet::default();
    for t in [a.clone(), b.clone(), a.clone(), a.clone(), b.clone()] {
        set.insert(t);
    }
    assert_eq!(set.iter().count(), 2);
    assert!(set.iter().any(|t| t.same(&a)) && set.iter().any(|t| t.same(&b)));
}
