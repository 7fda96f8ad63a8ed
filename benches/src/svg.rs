//! Hand-written SVG line charts for `benches/REPORT.md`: no plotting
//! library, no system packages.

use std::fmt::Write;

/// How an axis maps values to positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// Logarithmic, base 10, between the two bounds.
    Log {
        /// Smallest value shown.
        min: f64,
        /// Largest value shown.
        max: f64,
    },
    /// Quantiles in "nines": position `-log10(1 - q)`, from 0 up to
    /// `nines` (4 shows up to the 99.99th percentile; larger quantiles are
    /// drawn at the top).
    Nines {
        /// Nines at the far end.
        nines: f64,
    },
}

impl Scale {
    /// A log scale covering `values`, widened to whole 1-2-5 steps.
    pub fn log_covering(values: impl IntoIterator<Item = f64>) -> Scale {
        let (mut min, mut max) = (f64::INFINITY, 0f64);
        for v in values.into_iter().filter(|v| *v > 0.0 && v.is_finite()) {
            min = min.min(v);
            max = max.max(v);
        }
        if !min.is_finite() {
            return Scale::Log {
                min: 1.0,
                max: 10.0,
            };
        }
        let down = |v: f64| {
            let p = 10f64.powf(v.log10().floor());
            [5.0, 2.0, 1.0]
                .into_iter()
                .map(|m| m * p)
                .find(|s| *s <= v)
                .unwrap_or(p)
        };
        let up = |v: f64| {
            let p = 10f64.powf(v.log10().floor());
            [1.0, 2.0, 5.0, 10.0]
                .into_iter()
                .map(|m| m * p)
                .find(|s| *s >= v)
                .unwrap_or(10.0 * p)
        };
        let (min, max) = (down(min), up(max));
        if max <= min {
            Scale::Log {
                min,
                max: min * 10.0,
            }
        } else {
            Scale::Log { min, max }
        }
    }

    /// Position of `v` in 0..=1 along the axis.
    fn frac(self, v: f64) -> f64 {
        match self {
            Scale::Log { min, max } => ((v.max(min * 1e-3).log10() - min.log10())
                / (max.log10() - min.log10()))
            .clamp(0.0, 1.0),
            Scale::Nines { nines } => {
                let n = -(1.0 - v.clamp(0.0, 1.0)).max(10f64.powf(-nines)).log10();
                (n / nines).clamp(0.0, 1.0)
            }
        }
    }

    /// Tick values and their labels.
    fn ticks(self, unit: &str) -> Vec<(f64, String)> {
        match self {
            Scale::Log { min, max } => {
                let mut ticks = Vec::new();
                let mut p = 10f64.powf(min.log10().floor());
                while p <= max * 1.0001 {
                    for m in [1.0, 2.0, 5.0] {
                        let v = m * p;
                        if v >= min * 0.9999 && v <= max * 1.0001 {
                            ticks.push((v, format!("{}{unit}", human(v))));
                        }
                    }
                    p *= 10.0;
                }
                ticks
            }
            Scale::Nines { nines } => (0..=nines as u32)
                .map(|n| {
                    let q = 1.0 - 10f64.powi(-(n as i32));
                    let label = match n {
                        0 => "0%".to_owned(),
                        1 => "90%".to_owned(),
                        _ => {
                            let p = format!("{:.3}", 100.0 * q);
                            format!("{}%", p.trim_end_matches('0').trim_end_matches('.'))
                        }
                    };
                    (q, label)
                })
                .chain(std::iter::once((0.5, "50%".to_owned())))
                .collect(),
        }
    }
}

/// `1500` → `1.5k`, `2000000` → `2M`, `0.5` → `0.5`.
pub fn human(v: f64) -> String {
    let (v, suffix) = if v >= 1e6 {
        (v / 1e6, "M")
    } else if v >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}{suffix}")
}

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// CSS colour.
    pub color: &'static str,
    /// Dashed (baselines) or solid (ours).
    pub dashed: bool,
    /// `(x, y)` points, drawn in order.
    pub points: Vec<(f64, f64)>,
}

/// A line chart.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Title at the top.
    pub title: String,
    /// Horizontal axis label and scale.
    pub x_label: String,
    /// Horizontal scale.
    pub x: Scale,
    /// Unit appended to horizontal tick labels.
    pub x_unit: &'static str,
    /// Vertical axis label.
    pub y_label: String,
    /// Vertical scale.
    pub y: Scale,
    /// Unit appended to vertical tick labels.
    pub y_unit: &'static str,
    /// The lines.
    pub series: Vec<Series>,
}

/// Colours for series, in order.
pub const PALETTE: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Chart {
    /// The chart as a standalone SVG document.
    pub fn render(&self) -> String {
        let pw = W - LEFT - RIGHT;
        let ph = H - TOP - BOTTOM;
        let px = |x: f64| LEFT + self.x.frac(x) * pw;
        let py = |y: f64| TOP + (1.0 - self.y.frac(y)) * ph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            LEFT + pw / 2.0,
            esc(&self.title)
        );
        for (v, label) in self.x.ticks(self.x_unit) {
            let x = px(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + ph,
                TOP + ph + 16.0,
                esc(&label)
            );
        }
        for (v, label) in self.y.ticks(self.y_unit) {
            let y = py(v);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                esc(&label)
            );
        }
        let _ = writeln!(
            s,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 18.0,
            esc(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            esc(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let dash = if series.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            };
            let pts: Vec<String> = series
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
                pts.join(" "),
                series.color
            );
            for p in &pts {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(
                    s,
                    r#"<circle cx="{x}" cy="{y}" r="2.5" fill="{}"/>"#,
                    series.color
                );
            }
            let ly = TOP + 10.0 + 20.0 * i as f64;
            let lx = LEFT + pw + 15.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
                lx + 28.0,
                series.color,
                lx + 34.0,
                ly + 4.0,
                esc(&series.label)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_and_render() {
        assert_eq!(human(1500.0), "1.5k");
        assert_eq!(human(2e6), "2M");
        assert_eq!(human(0.5), "0.5");
        assert_eq!(
            Scale::log_covering([3.0, 70.0]),
            Scale::Log {
                min: 2.0,
                max: 100.0
            }
        );
        let n = Scale::Nines { nines: 4.0 };
        assert_eq!(n.frac(0.0), 0.0);
        assert!((n.frac(0.99) - 0.5).abs() < 1e-9);
        assert_eq!(n.frac(1.0), 1.0);
        let chart = Chart {
            title: "t <1>".into(),
            x_label: "x".into(),
            x: n,
            x_unit: "",
            y_label: "y".into(),
            y: Scale::log_covering([1.0, 1000.0]),
            y_unit: " µs",
            series: vec![Series {
                label: "a".into(),
                color: PALETTE[0],
                dashed: true,
                points: vec![(0.0, 1.0), (0.5, 10.0), (1.0, 1000.0)],
            }],
        };
        let svg = chart.render();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("t &lt;1&gt;") && svg.contains("99.9%"));
    }
}
