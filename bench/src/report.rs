//! SVG charts for reports: panels of horizontal grouped bars (one group per target, one bar per
//! series), with optional reference lines (oracle, ceiling). Plain SVG text: no plotting
//! dependency, readable in any browser and on GitHub.

use std::fmt::Write as _;

#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub labels: Vec<String>,
    /// (name, one value per label)
    pub series: Vec<(String, Vec<f64>)>,
    /// Vertical reference lines: (name, value).
    pub refs: Vec<(String, f64)>,
    pub unit: String,
}

const COLORS: [&str; 4] = ["#4477aa", "#ee6677", "#228833", "#ccbb44"];
const WIDTH: f64 = 760.0;
const LEFT: f64 = 220.0;
const BAR: f64 = 14.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn fmt(v: f64, unit: &str) -> String {
    if !v.is_finite() {
        return "—".into();
    }
    if v.abs() < 10.0 && unit.is_empty() {
        format!("{v:.3}")
    } else {
        format!("{v:.0}{unit}")
    }
}

/// Panels stacked vertically in one SVG document.
pub fn svg(charts: &[Chart]) -> String {
    let mut body = String::new();
    let mut y = 10.0;
    for c in charts {
        y = panel(&mut body, c, y) + 20.0;
    }
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{y}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{body}</svg>\n"
    )
}

fn panel(out: &mut String, c: &Chart, top: f64) -> f64 {
    let plot_w = WIDTH - LEFT - 90.0;
    let max = c
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .chain(c.refs.iter().map(|r| r.1))
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max)
        .max(1e-9);
    let x = |v: f64| LEFT + plot_w * (v / max).clamp(0.0, 1.0);
    let _ = writeln!(
        out,
        "<text x=\"10\" y=\"{}\" font-weight=\"bold\" font-size=\"14\">{}</text>",
        top + 14.0,
        esc(&c.title)
    );
    // Legend.
    let mut lx = LEFT;
    for (k, (name, _)) in c.series.iter().enumerate() {
        let _ = writeln!(
            out,
            "<rect x=\"{lx}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>",
            top + 22.0,
            COLORS[k % COLORS.len()],
            lx + 14.0,
            top + 31.0,
            esc(name)
        );
        lx += 24.0 + 7.0 * name.len() as f64;
    }
    for (name, _) in &c.refs {
        let _ = writeln!(
            out,
            "<line x1=\"{lx}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333\" stroke-dasharray=\"4 3\"/><text x=\"{}\" y=\"{}\">{}</text>",
            top + 27.0,
            lx + 16.0,
            top + 27.0,
            lx + 20.0,
            top + 31.0,
            esc(name)
        );
        lx += 30.0 + 7.0 * name.len() as f64;
    }
    let group = BAR * c.series.len() as f64 + 10.0;
    let y0 = top + 42.0;
    for (i, label) in c.labels.iter().enumerate() {
        let gy = y0 + group * i as f64;
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            LEFT - 6.0,
            gy + group / 2.0,
            esc(label)
        );
        for (k, (_, values)) in c.series.iter().enumerate() {
            let v = values.get(i).copied().unwrap_or(f64::NAN);
            let by = gy + BAR * k as f64;
            let w = if v.is_finite() { x(v) - LEFT } else { 0.0 };
            let _ = writeln!(
                out,
                "<rect x=\"{LEFT}\" y=\"{by}\" width=\"{w:.1}\" height=\"{}\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{}\" font-size=\"11\">{}</text>",
                BAR - 2.0,
                COLORS[k % COLORS.len()],
                LEFT + w + 4.0,
                by + BAR - 4.0,
                fmt(v, &c.unit)
            );
        }
    }
    let bottom = y0 + group * c.labels.len() as f64;
    for (_, v) in &c.refs {
        let rx = x(*v);
        let _ = writeln!(
            out,
            "<line x1=\"{rx:.1}\" y1=\"{y0}\" x2=\"{rx:.1}\" y2=\"{bottom}\" stroke=\"#333\" stroke-dasharray=\"4 3\"/>"
        );
    }
    let _ = writeln!(out, "<line x1=\"{LEFT}\" y1=\"{y0}\" x2=\"{LEFT}\" y2=\"{bottom}\" stroke=\"#999\"/>");
    bottom
}

/// Prints a markdown report and, unless `quick`, writes it to `out` or to
/// `bench/results/{stem}-DATE.md`.
pub fn publish(md: &str, stem: &str, out: Option<std::path::PathBuf>, quick: bool) -> anyhow::Result<()> {
    print!("{md}");
    if !quick {
        let out =
            out.unwrap_or_else(|| crate::targets::root().join(format!("bench/results/{stem}-{}.md", date())));
        std::fs::write(&out, md)?;
        eprintln!("written: {}", out.display());
    }
    Ok(())
}

/// Today's date (UTC), `YYYY-MM-DD`: what names a report.
pub fn date() -> String {
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_one_bar_per_value_and_escapes_labels() {
        let s = svg(&[Chart {
            title: "t".into(),
            labels: vec!["a<b".into(), "c".into()],
            series: vec![("x".into(), vec![1.0, 2.0]), ("y".into(), vec![f64::NAN, 4.0])],
            refs: vec![("ref".into(), 3.0)],
            unit: " ms".into(),
        }]);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("a&lt;b") && !s.contains("a<b"));
        // 2 legend squares + 4 bars + the background.
        assert_eq!(s.matches("<rect").count(), 7);
        assert!(s.contains(">4 ms<") && s.contains(">—<"));
    }
}
