//! Conversions between wire messages and the scheduler's domain types
//! (`from_proto` / `to_proto`). Domain code never matches on generated structs.

use std::collections::HashMap;

use tpuray_scheduler::{LabelConstraint, LabelOp, ResourceError, ResourceSet};

use crate::pb;

/// A resource map from the wire, validated.
///
/// # Errors
/// [`ResourceError`] naming the resource with a negative, NaN or infinite amount.
pub fn resources_from_proto(m: &HashMap<String, f64>) -> Result<ResourceSet, ResourceError> {
    ResourceSet::from_f64_map(m.iter())
}

/// A resource set as a wire map.
pub fn resources_to_proto(r: &ResourceSet) -> HashMap<String, f64> {
    r.to_f64_map()
}

/// Label constraints from the wire.
///
/// # Errors
/// A message naming the constraint with an unknown operator or empty key.
pub fn labels_from_proto(v: &[pb::LabelConstraint]) -> Result<Vec<LabelConstraint>, String> {
    v.iter()
        .map(|c| {
            if c.key.is_empty() {
                return Err("label constraint has an empty key".to_string());
            }
            let op = match pb::label_constraint::Op::try_from(c.op) {
                Ok(pb::label_constraint::Op::In) => LabelOp::In(c.values.clone()),
                Ok(pb::label_constraint::Op::NotIn) => LabelOp::NotIn(c.values.clone()),
                Ok(pb::label_constraint::Op::Exists) => LabelOp::Exists,
                Ok(pb::label_constraint::Op::DoesNotExist) => LabelOp::DoesNotExist,
                _ => {
                    return Err(format!(
                        "label constraint on {:?} has unknown operator {} (expected in, not_in, exists or does_not_exist)",
                        c.key, c.op
                    ));
                }
            };
            Ok(LabelConstraint {
                key: c.key.clone(),
                op,
            })
        })
        .collect()
}

/// Label constraints as wire messages.
pub fn labels_to_proto(v: &[LabelConstraint]) -> Vec<pb::LabelConstraint> {
    use pb::label_constraint::Op;
    v.iter()
        .map(|c| {
            let (op, values) = match &c.op {
                LabelOp::In(v) => (Op::In, v.clone()),
                LabelOp::NotIn(v) => (Op::NotIn, v.clone()),
                LabelOp::Exists => (Op::Exists, vec![]),
                LabelOp::DoesNotExist => (Op::DoesNotExist, vec![]),
            };
            pb::LabelConstraint { key: c.key.clone(), op: op as i32, values }
        })
        .collect()
}

/// A scheduling strategy from the wire, with node ids as strings.
pub fn strategy_from_proto(
    s: Option<&pb::SchedulingStrategy>,
) -> tpuray_scheduler::Strategy<String> {
    use pb::scheduling_strategy::Kind;
    match s.and_then(|s| s.kind.as_ref()) {
        Some(Kind::Spread(_)) => tpuray_scheduler::Strategy::Spread,
        Some(Kind::NodeAffinity(a)) => {
            tpuray_scheduler::Strategy::NodeAffinity { node: a.node_id.clone(), soft: a.soft }
        }
        _ => tpuray_scheduler::Strategy::Default,
    }
}

/// The placement group and bundle index (-1: any bundle) of a
/// `PlacementGroup` strategy; `None` for every other strategy.
pub fn placement_group_from_proto(s: Option<&pb::SchedulingStrategy>) -> Option<(String, i32)> {
    match s.and_then(|s| s.kind.as_ref()) {
        Some(pb::scheduling_strategy::Kind::PlacementGroup(p)) => {
            Some((p.placement_group_id.clone(), p.bundle_index))
        }
        _ => None,
    }
}

/// A `PlacementGroup` strategy as a wire message.
pub fn placement_group_to_proto(pg: &str, bundle_index: i32) -> pb::SchedulingStrategy {
    pb::SchedulingStrategy {
        kind: Some(pb::scheduling_strategy::Kind::PlacementGroup(
            pb::scheduling_strategy::PlacementGroup {
                placement_group_id: pg.to_string(),
                bundle_index,
            },
        )),
    }
}

/// A scheduling strategy as a wire message.
pub fn strategy_to_proto(s: &tpuray_scheduler::Strategy<String>) -> pb::SchedulingStrategy {
    use pb::scheduling_strategy::{Default, Kind, NodeAffinity, Spread};
    let kind = match s {
        tpuray_scheduler::Strategy::Default => Kind::Default(Default {}),
        tpuray_scheduler::Strategy::Spread => Kind::Spread(Spread {}),
        tpuray_scheduler::Strategy::NodeAffinity { node, soft } => {
            Kind::NodeAffinity(NodeAffinity { node_id: node.clone(), soft: *soft })
        }
    };
    pb::SchedulingStrategy { kind: Some(kind) }
}
