//! Order statistics shared by every benchmark's report.

/// The `p` quantile (0–1, nearest rank) of `v`; NaN when `v` is empty.
pub fn quantile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The upper median of `v` (the middle element, or the higher of the two middle ones).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_medians() {
        let v = vec![5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(quantile(v.clone(), 0.0), 1.0);
        assert_eq!(quantile(v.clone(), 0.5), 3.0);
        assert_eq!(quantile(v.clone(), 1.0), 5.0);
        assert_eq!(median(v), 3.0);
        assert_eq!(median(vec![1.0, 2.0]), 2.0);
        assert!(quantile(Vec::new(), 0.5).is_nan() && median(Vec::new()).is_nan());
    }
}
