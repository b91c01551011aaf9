//! Resource amounts in exact fixed point ([`Amount`]) and named sets of them ([`ResourceSet`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

/// Units per whole resource: 1 unit = 1/10_000 of a CPU, GPU, byte of memory, ...
pub const UNITS_PER_WHOLE: i64 = 10_000;

/// A problem with a resource name, amount or `--resources` JSON.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ResourceError {
    /// The name is empty or holds whitespace or control characters.
    #[error(
        "invalid resource name {0:?} (expected a non-empty name without whitespace or control characters)"
    )]
    InvalidName(String),
    /// The amount is NaN or infinite.
    #[error("resource {name:?} has non-finite amount {value} (expected a number >= 0)")]
    NonFinite { name: String, value: f64 },
    /// The amount is below zero.
    #[error("resource {name:?} has negative amount {value} (expected a number >= 0)")]
    Negative { name: String, value: f64 },
    /// The amount does not fit in the fixed-point range.
    #[error("resource {name:?} has amount {value} that is too large (expected at most {max})", max = i64::MAX / UNITS_PER_WHOLE)]
    TooLarge { name: String, value: f64 },
    /// A JSON value that is not a number; `value` is the JSON text.
    #[error("resource {name:?} has non-numeric amount {value} (expected a number >= 0)")]
    NonNumeric { name: String, value: String },
    /// The text is not JSON at all; holds serde_json's message.
    #[error(
        "invalid --resources JSON: {0} (expected an object of name: number, e.g. {{\"special\": 1}})"
    )]
    InvalidJson(String),
    /// Valid JSON that is not an object; holds the JSON text.
    #[error(
        "invalid --resources JSON: got {0} (expected an object of name: number, e.g. {{\"special\": 1}})"
    )]
    NotAnObject(String),
}

/// Fixed-point amount: 1 unit = 1/10_000 of a resource. 0.1 + 0.2 == 0.3 exactly (SCHED-1).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Amount(pub i64);

impl Amount {
    /// No resource.
    pub const ZERO: Amount = Amount(0);

    /// Converts a float amount (in whole resources) for resource `name`, rounding to the
    /// nearest 1/10_000 (SCHED-1). Errors: NaN or infinity, negative, or above ~9.2e14.
    pub fn from_f64(name: &str, v: f64) -> Result<Amount, ResourceError> {
        let name = name.to_string();
        if !v.is_finite() {
            return Err(ResourceError::NonFinite { name, value: v });
        }
        if v < 0.0 {
            return Err(ResourceError::Negative { name, value: v });
        }
        let units = (v * UNITS_PER_WHOLE as f64).round();
        if units >= i64::MAX as f64 {
            return Err(ResourceError::TooLarge { name, value: v });
        }
        Ok(Amount(units as i64))
    }

    /// The amount in whole resources, e.g. `Amount(5_000).to_f64() == 0.5`.
    pub fn to_f64(self) -> f64 {
        self.0 as f64 / UNITS_PER_WHOLE as f64
    }

    /// `n` whole resources (saturates at the largest amount).
    pub fn whole(n: u64) -> Amount {
        Amount(i64::try_from(n).unwrap_or(i64::MAX).saturating_mul(UNITS_PER_WHOLE))
    }
}

impl fmt::Display for Amount {
    /// Exact decimal in whole resources without trailing zeros: `1`, `0.5`, `0.0001`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let (abs, scale) = (self.0.unsigned_abs(), UNITS_PER_WHOLE as u64);
        let (whole, frac) = (abs / scale, abs % scale);
        if frac == 0 {
            return write!(f, "{sign}{whole}");
        }
        let frac = format!("{frac:04}");
        write!(f, "{sign}{whole}.{}", frac.trim_end_matches('0'))
    }
}

/// Named resource amounts. Zero (or negative) amounts are never stored (SCHED-2), so two
/// sets that mean the same thing compare equal. Serializes as a map of name to units.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "BTreeMap<String, Amount>", into = "BTreeMap<String, Amount>")]
pub struct ResourceSet {
    amounts: BTreeMap<String, Amount>,
}

/// Checks a resource name: non-empty, no whitespace or control characters.
pub fn validate_resource_name(name: &str) -> Result<(), ResourceError> {
    if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ResourceError::InvalidName(name.to_string()));
    }
    Ok(())
}

impl ResourceSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a set from float amounts in whole resources. Errors: an invalid name, or an
    /// amount that [`Amount::from_f64`] rejects.
    pub fn from_f64_map<'a>(
        it: impl IntoIterator<Item = (&'a String, &'a f64)>,
    ) -> Result<Self, ResourceError> {
        let mut set = ResourceSet::new();
        for (name, v) in it {
            validate_resource_name(name)?;
            set.set(name, Amount::from_f64(name, *v)?);
        }
        Ok(set)
    }

    /// Parses `--resources` JSON such as `{"special": 1, "GPU": 0.5}`. Errors: unparsable
    /// JSON, not an object, an invalid name, a non-numeric, negative or too large amount.
    pub fn from_json(s: &str) -> Result<Self, ResourceError> {
        let value: serde_json::Value =
            serde_json::from_str(s).map_err(|e| ResourceError::InvalidJson(e.to_string()))?;
        let serde_json::Value::Object(map) = value else {
            return Err(ResourceError::NotAnObject(value.to_string()));
        };
        let mut set = ResourceSet::new();
        for (name, v) in &map {
            validate_resource_name(name)?;
            let Some(f) = v.as_f64() else {
                let value = v.to_string();
                return Err(ResourceError::NonNumeric { name: name.clone(), value });
            };
            set.set(name, Amount::from_f64(name, f)?);
        }
        Ok(set)
    }

    /// The amounts as floats in whole resources (the form Ray reports).
    pub fn to_f64_map(&self) -> HashMap<String, f64> {
        self.iter().map(|(k, v)| (k.to_string(), v.to_f64())).collect()
    }

    /// Sets `name` to `amount`; an amount <= 0 removes the name (SCHED-2). Does not validate
    /// the name.
    pub fn set(&mut self, name: &str, amount: Amount) {
        if amount.0 > 0 {
            self.amounts.insert(name.to_string(), amount);
        } else {
            self.amounts.remove(name);
        }
    }

    /// The amount of `name`, zero when absent.
    pub fn get(&self, name: &str) -> Amount {
        self.amounts.get(name).copied().unwrap_or(Amount::ZERO)
    }

    /// True when no resource has a positive amount.
    pub fn is_empty(&self) -> bool {
        self.amounts.is_empty()
    }

    /// The (name, amount) pairs in name order; every amount is positive.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Amount)> {
        self.amounts.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// True when `self` has at least as much as `other` of every resource `other` names.
    pub fn is_superset_of(&self, other: &ResourceSet) -> bool {
        other.iter().all(|(k, v)| self.get(k) >= v)
    }

    /// Adds `other` to `self` (saturating at the largest amount).
    pub fn add(&mut self, other: &ResourceSet) {
        for (k, v) in other.iter() {
            self.set(k, Amount(self.get(k).0.saturating_add(v.0)));
        }
    }

    /// Subtracts `other` from `self`, stopping at zero (SCHED-2).
    pub fn saturating_sub(&mut self, other: &ResourceSet) {
        for (k, v) in other.iter() {
            self.set(k, Amount((self.get(k).0 - v.0).max(0)));
        }
    }

    /// `self - other`, or `None` when `self` lacks some of `other`.
    pub fn checked_sub(&self, other: &ResourceSet) -> Option<ResourceSet> {
        if !self.is_superset_of(other) {
            return None;
        }
        let mut out = self.clone();
        out.saturating_sub(other);
        Some(out)
    }

    /// First resource (in name order) of `self` that `total` lacks or has less of:
    /// (name, requested, total), amounts in whole resources.
    pub fn first_missing(&self, total: &ResourceSet) -> Option<(String, f64, f64)> {
        self.iter()
            .find(|(k, v)| total.get(k) < *v)
            .map(|(k, v)| (k.to_string(), v.to_f64(), total.get(k).to_f64()))
    }
}

impl fmt::Display for ResourceSet {
    /// `{CPU: 1, special: 0.5}`; `{}` when empty.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (k, v)) in self.iter().enumerate() {
            write!(f, "{}{k}: {v}", if i == 0 { "" } else { ", " })?;
        }
        f.write_str("}")
    }
}

impl TryFrom<BTreeMap<String, Amount>> for ResourceSet {
    type Error = ResourceError;
    /// Validates names and amounts (units must be >= 0) and drops zeros (SCHED-2).
    fn try_from(map: BTreeMap<String, Amount>) -> Result<Self, ResourceError> {
        let mut set = ResourceSet::new();
        for (name, v) in map {
            validate_resource_name(&name)?;
            if v.0 < 0 {
                return Err(ResourceError::Negative { value: v.to_f64(), name });
            }
            set.set(&name, v);
        }
        Ok(set)
    }
}

impl From<ResourceSet> for BTreeMap<String, Amount> {
    fn from(set: ResourceSet) -> Self {
        set.amounts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rs(json: &str) -> ResourceSet {
        ResourceSet::from_json(json).unwrap()
    }

    /// SCHED-1: fixed-point amounts add exactly (0.1 + 0.2 CPU == 0.3).
    #[test]
    fn zero_point_one_plus_zero_point_two_cpu_is_exactly_zero_point_three_sched_1() {
        let mut a = rs(r#"{"CPU": 0.1}"#);
        a.add(&rs(r#"{"CPU": 0.2}"#));
        assert_eq!(a.get("CPU"), Amount::from_f64("CPU", 0.3).unwrap());
        assert_eq!(a.get("CPU").to_f64(), 0.3);
        assert_eq!(a.to_string(), "{CPU: 0.3}");
    }

    #[test]
    fn from_f64_rounds_to_nearest_ten_thousandth_and_rejects_bad_values() {
        let cases: &[(f64, Result<i64, &str>)] = &[
            (1.0, Ok(10_000)),
            (0.00004, Ok(0)),
            (0.00005, Ok(1)),
            (0.123456, Ok(1_235)),
            (-1.0, Err(r#"resource "CPU" has negative amount -1 (expected a number >= 0)"#)),
            (f64::NAN, Err(r#"resource "CPU" has non-finite amount NaN (expected a number >= 0)"#)),
            (f64::INFINITY, Err("non-finite amount inf")),
            (1e30, Err("too large")),
        ];
        for (v, want) in cases {
            let got = Amount::from_f64("CPU", *v).map(|a| a.0).map_err(|e| e.to_string());
            match want {
                Ok(units) => assert_eq!(got, Ok(*units), "{v}"),
                Err(msg) => assert!(got.as_ref().unwrap_err().contains(msg), "{v}: {got:?}"),
            }
        }
        assert_eq!(Amount::whole(3), Amount(30_000));
        assert_eq!(Amount::whole(u64::MAX), Amount(i64::MAX));
    }

    #[test]
    fn from_json_errors_name_the_key_and_value() {
        let cases = [
            (
                r#"{"x": "abc"}"#,
                r#"resource "x" has non-numeric amount "abc" (expected a number >= 0)"#,
            ),
            (r#"{"x": -1}"#, r#"resource "x" has negative amount -1 (expected a number >= 0)"#),
            (r#"{"x": null}"#, r#"resource "x" has non-numeric amount null"#),
            (r#"{"a b": 1}"#, r#"invalid resource name "a b""#),
            (r#"{"": 1}"#, r#"invalid resource name """#),
            ("[1]", "invalid --resources JSON: got [1] (expected an object of name: number"),
            ("{special", "invalid --resources JSON: key must be a string"),
            ("", r#"(expected an object of name: number, e.g. {"special": 1})"#),
        ];
        for (json, want) in cases {
            let err = ResourceSet::from_json(json).unwrap_err().to_string();
            assert!(err.contains(want), "{json}: {err}");
        }
    }

    #[test]
    fn negative_resource_in_json_is_rejected_naming_key() {
        let err = ResourceSet::from_json(r#"{"special": -0.5}"#).unwrap_err();
        assert_eq!(err, ResourceError::Negative { name: "special".into(), value: -0.5 });
    }

    #[test]
    fn non_numeric_resource_is_rejected() {
        let err = ResourceSet::from_json(r#"{"GPU": true}"#).unwrap_err().to_string();
        assert_eq!(err, r#"resource "GPU" has non-numeric amount true (expected a number >= 0)"#);
    }

    #[test]
    fn zero_amounts_are_never_stored_sched_2() {
        let mut s = rs(r#"{"CPU": 2, "GPU": 0, "x": 0.00001}"#);
        assert_eq!(s, rs(r#"{"CPU": 2}"#));
        s.set("CPU", Amount::ZERO);
        assert!(s.is_empty());
        assert_eq!(s, ResourceSet::new());
    }

    #[test]
    fn subtraction_never_goes_below_zero_sched_2() {
        let mut s = rs(r#"{"CPU": 1, "GPU": 1}"#);
        assert_eq!(s.checked_sub(&rs(r#"{"CPU": 2}"#)), None);
        assert_eq!(s.checked_sub(&rs(r#"{"CPU": 0.5}"#)), Some(rs(r#"{"CPU": 0.5, "GPU": 1}"#)));
        s.saturating_sub(&rs(r#"{"CPU": 3, "TPU": 1}"#));
        assert_eq!(s, rs(r#"{"GPU": 1}"#));
    }

    #[test]
    fn superset_and_first_missing_compare_per_name() {
        let total = rs(r#"{"CPU": 4, "GPU": 1}"#);
        assert!(total.is_superset_of(&rs(r#"{"CPU": 4}"#)));
        assert!(total.is_superset_of(&ResourceSet::new()));
        assert!(!total.is_superset_of(&rs(r#"{"CPU": 1, "TPU": 1}"#)));
        let want = rs(r#"{"CPU": 8, "GPU": 0.5, "TPU": 4}"#);
        assert_eq!(want.first_missing(&total), Some(("CPU".into(), 8.0, 4.0)));
        assert_eq!(rs(r#"{"GPU": 1}"#).first_missing(&total), None);
    }

    #[test]
    fn display_f64_map_and_serde_round_trip() {
        let s = rs(r#"{"special": 0.5, "CPU": 1, "memory": 1e9}"#);
        assert_eq!(s.to_string(), "{CPU: 1, memory: 1000000000, special: 0.5}");
        assert_eq!(ResourceSet::from_f64_map(&s.to_f64_map()), Ok(s.clone()));
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, r#"{"CPU":10000,"memory":10000000000000,"special":5000}"#);
        assert_eq!(serde_json::from_str::<ResourceSet>(&json).unwrap(), s);
        assert!(serde_json::from_str::<ResourceSet>(r#"{"CPU":-1}"#).is_err());
        assert_eq!(
            serde_json::from_str::<ResourceSet>(r#"{"CPU":0}"#).unwrap(),
            ResourceSet::new()
        );
    }
}
