//! Resource names of committed placement-group bundles (Ray's scheme, from Ray's
//! `BundleSpecification` / `FormatPlacementGroupResource`): a bundle `{"CPU": 2}` at index
//! `i` of group `pg`, once committed on a node, adds `CPU_group_i_pg: 2` (indexed) and
//! `CPU_group_pg: 2` (wildcard, summed over the group's bundles on that node) to the
//! node, plus `bundle_group_i_pg` / `bundle_group_pg` markers of 1000 units each so that a
//! task needing no resources can still be held to a bundle.
//!
//! Work scheduled into a bundle asks for the renamed resources instead of the plain ones
//! ([`demand_in_bundle`]), so the ordinary policy places it on the node holding the
//! bundle and never lets it use more than the bundle reserved (SCHED-19).

use crate::resources::{Amount, ResourceSet, UNITS_PER_WHOLE};

/// The marker resource every committed bundle adds (Ray: `bundle`).
pub const BUNDLE_MARKER: &str = "bundle";
/// Units of the marker per bundle (Ray uses 1000).
const MARKER_PER_BUNDLE: Amount = Amount(1000 * UNITS_PER_WHOLE);
/// What one piece of work takes from the marker (Ray: 0.001).
const MARKER_PER_TASK: Amount = Amount(UNITS_PER_WHOLE / 1000);

/// `name_group_i_pg`.
pub fn indexed_name(name: &str, pg: &str, index: u32) -> String {
    format!("{name}_group_{index}_{pg}")
}

/// `name_group_pg`.
pub fn wildcard_name(name: &str, pg: &str) -> String {
    format!("{name}_group_{pg}")
}

/// What committing bundle `index` (`demand`) of group `pg` adds to its node: every resource
/// under its indexed and wildcard names, plus the bundle markers.
pub fn bundle_resources(demand: &ResourceSet, pg: &str, index: u32) -> ResourceSet {
    let mut out = ResourceSet::new();
    for (name, amount) in demand.iter().chain([(BUNDLE_MARKER, MARKER_PER_BUNDLE)]) {
        out.set(&indexed_name(name, pg, index), amount);
        out.set(&wildcard_name(name, pg), amount);
    }
    out
}

/// What work needing `demand` asks for inside group `pg`: bundle `index`, or any bundle
/// when `None`. An indexed request takes from both the indexed and the wildcard names, so
/// the wildcard total of a node never over-counts (Ray does the same).
pub fn demand_in_bundle(demand: &ResourceSet, pg: &str, index: Option<u32>) -> ResourceSet {
    let mut out = ResourceSet::new();
    for (name, amount) in demand.iter().chain([(BUNDLE_MARKER, MARKER_PER_TASK)]) {
        if let Some(i) = index {
            out.set(&indexed_name(name, pg, i), amount);
        }
        out.set(&wildcard_name(name, pg), amount);
    }
    out
}

/// A resource name split into (plain name, bundle index, group id) when it is a bundle
/// resource: `CPU_group_0_pg` → `("CPU", Some(0), "pg")`, `CPU_group_pg` → `("CPU", None,
/// "pg")`. `pg` is whatever follows, so group ids must not contain `_group_`.
pub fn parse_bundle_resource(name: &str) -> Option<(&str, Option<u32>, &str)> {
    let (base, rest) = name.rsplit_once("_group_")?;
    if base.is_empty() || rest.is_empty() {
        return None;
    }
    match rest.split_once('_') {
        Some((i, pg)) if !pg.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => {
            i.parse().ok().map(|i| (base, Some(i), pg))
        }
        _ => Some((base, None, rest)),
    }
}

/// Whether `name` belongs to group `pg` (indexed or wildcard).
pub fn is_resource_of_group(name: &str, pg: &str) -> bool {
    parse_bundle_resource(name).is_some_and(|(_, _, g)| g == pg)
}

/// The amount of plain resource `base` that `demand` asks for, directly or through a bundle
/// (the indexed name first, then the wildcard): how many `TPU` chips a request inside a
/// group needs, for example.
pub fn plain_amount(demand: &ResourceSet, base: &str) -> Amount {
    let direct = demand.get(base);
    if direct.0 > 0 {
        return direct;
    }
    let mut wildcard = Amount::ZERO;
    for (name, amount) in demand.iter() {
        match parse_bundle_resource(name) {
            Some((b, Some(_), _)) if b == base => return amount,
            Some((b, None, _)) if b == base => wildcard = amount,
            _ => {}
        }
    }
    wildcard
}

/// `total` without bundle resources: what a node has of its own (for `status`).
pub fn without_bundle_resources(total: &ResourceSet) -> ResourceSet {
    let mut out = ResourceSet::new();
    for (name, amount) in total.iter().filter(|(n, _)| parse_bundle_resource(n).is_none()) {
        out.set(name, amount);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::res;

    #[test]
    fn committed_bundle_adds_indexed_wildcard_and_marker_names() {
        let r = bundle_resources(&res(r#"{"CPU": 2, "TPU": 4}"#), "pg1", 3);
        assert_eq!(r.get("CPU_group_3_pg1"), Amount::whole(2));
        assert_eq!(r.get("CPU_group_pg1"), Amount::whole(2));
        assert_eq!(r.get("TPU_group_3_pg1"), Amount::whole(4));
        assert_eq!(r.get("bundle_group_3_pg1"), Amount::whole(1000));
        assert_eq!(r.get("bundle_group_pg1"), Amount::whole(1000));
        assert_eq!(r.iter().count(), 6);
    }

    #[test]
    fn demand_in_a_bundle_takes_indexed_and_wildcard_names() {
        let d = demand_in_bundle(&res(r#"{"CPU": 1}"#), "pg", Some(0));
        assert_eq!(d.get("CPU_group_0_pg"), Amount::whole(1));
        assert_eq!(d.get("CPU_group_pg"), Amount::whole(1));
        assert_eq!(d.get("bundle_group_0_pg"), Amount(10));
        let any = demand_in_bundle(&ResourceSet::new(), "pg", None);
        assert_eq!(any.iter().collect::<Vec<_>>(), vec![("bundle_group_pg", Amount(10))]);
    }

    /// SCHED-19: a bundle holds exactly what it reserved, whatever mix of indexed and
    /// wildcard requests arrives.
    #[test]
    fn wildcard_and_indexed_requests_never_exceed_the_bundles() {
        let mut node = bundle_resources(&res(r#"{"CPU": 1}"#), "pg", 0);
        node.add(&bundle_resources(&res(r#"{"CPU": 1}"#), "pg", 1));
        let any = demand_in_bundle(&res(r#"{"CPU": 1}"#), "pg", None);
        let zero = demand_in_bundle(&res(r#"{"CPU": 1}"#), "pg", Some(0));
        let one = demand_in_bundle(&res(r#"{"CPU": 1}"#), "pg", Some(1));
        assert!(node.is_superset_of(&any));
        node.saturating_sub(&any);
        assert!(node.is_superset_of(&zero));
        node.saturating_sub(&zero);
        assert!(!node.is_superset_of(&one), "both CPUs are in use: {node}");
    }

    #[test]
    fn bundle_resource_names_parse_back() {
        assert_eq!(parse_bundle_resource("CPU_group_0_abc"), Some(("CPU", Some(0), "abc")));
        assert_eq!(parse_bundle_resource("CPU_group_abc"), Some(("CPU", None, "abc")));
        assert_eq!(
            parse_bundle_resource("accelerator_type:TPU-V6E_group_2_p"),
            Some(("accelerator_type:TPU-V6E", Some(2), "p"))
        );
        assert_eq!(parse_bundle_resource("CPU"), None);
        assert!(is_resource_of_group("TPU_group_1_p", "p"));
        assert!(!is_resource_of_group("TPU_group_1_q", "p"));
    }

    #[test]
    fn plain_amount_reads_through_bundle_names() {
        assert_eq!(plain_amount(&res(r#"{"TPU": 4}"#), "TPU"), Amount::whole(4));
        let d = demand_in_bundle(&res(r#"{"TPU": 2}"#), "pg", Some(1));
        assert_eq!(plain_amount(&d, "TPU"), Amount::whole(2));
        let d = demand_in_bundle(&res(r#"{"TPU": 8}"#), "pg", None);
        assert_eq!(plain_amount(&d, "TPU"), Amount::whole(8));
        assert_eq!(plain_amount(&d, "GPU"), Amount::ZERO);
    }
}
