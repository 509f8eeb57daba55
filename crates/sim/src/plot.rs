//! SVG line charts of hit or miss ratio against cache size, drawn with `plotters` (its SVG
//! backend only: no system fonts are needed, the viewer lays out the text).

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

/// What went wrong drawing a chart.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlotError {
    #[error("a chart needs at least one series with at least one point")]
    Empty,
    #[error("series {series:?}: point ({x}, {y}) is not finite")]
    NotFinite { series: String, x: f64, y: f64 },
    #[error("series {series:?}: cache size {x} must be positive on a logarithmic axis")]
    NotPositive { series: String, x: f64 },
    #[error("drawing the chart: {0}")]
    Draw(String),
}

/// What the x values are and how their labels read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeAxis {
    /// Bytes, labelled in binary units (KiB, MiB, GiB, TiB).
    Bytes,
    /// Percent of the trace's footprint (0 to 100).
    PercentOfFootprint,
}

/// What the y values are (always in [0, 1]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RatioAxis {
    HitRatio,
    MissRatio,
}

/// One named line.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    /// (cache size, ratio) pairs, drawn in this order.
    pub points: Vec<(f64, f64)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LineChart {
    pub title: String,
    pub x: SizeAxis,
    pub y: RatioAxis,
    /// A logarithmic x axis, for sizes that grow by factors (1 GiB, 4 GiB, 16 GiB...).
    pub log_x: bool,
    pub series: Vec<Series>,
}

const WIDTH: u32 = 960;
const HEIGHT: u32 = 600;
const FONT: &str = "sans-serif";

/// Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
const COLOURS: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(230, 159, 0),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
];

/// The largest binary unit in which `bytes` is at least 1, and its size in bytes.
fn binary_unit(bytes: f64) -> (f64, &'static str) {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut divisor = 1.0;
    let mut unit = 0;
    while bytes.abs() >= divisor * 1024.0 && unit + 1 < UNITS.len() {
        divisor *= 1024.0;
        unit += 1;
    }
    (divisor, UNITS[unit])
}

/// `x` with at most two decimals and no trailing zeros.
fn trim_decimals(x: f64) -> String {
    let text = format!("{x:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// `bytes` in the largest binary unit that keeps it at least 1, with at most two decimals
/// ("512 B", "4 KiB", "1.5 GiB").
pub fn format_bytes(bytes: f64) -> String {
    let (divisor, unit) = binary_unit(bytes);
    format!("{} {unit}", trim_decimals(bytes / divisor))
}

impl LineChart {
    /// The chart as an SVG document.
    pub fn to_svg(&self) -> Result<String, PlotError> {
        let (x_min, x_max) = self.x_extent()?;
        let mut svg = String::new();
        if self.log_x {
            let (low, high) = if x_min == x_max {
                (x_min / 2.0, x_max * 2.0)
            } else {
                (x_min, x_max)
            };
            // Base 2: ticks at powers of two, which binary units print as round numbers.
            let labels = |x: &f64| self.x_label(*x);
            self.draw(&mut svg, (low..high).log_scale().base(2.0), 1.0, &labels)?;
        } else {
            // Ticks are chosen in decimal steps, so draw in the unit of the labels: 50 GiB,
            // 100 GiB... rather than 5e10 bytes shown as 46.57 GiB.
            // A unit at most a quarter of the largest size, so ticks are not fractions.
            let (divisor, unit) = match self.x {
                SizeAxis::Bytes => binary_unit(x_max / 4.0),
                SizeAxis::PercentOfFootprint => (1.0, "%"),
            };
            let low = if x_min >= 0.0 { 0.0 } else { x_min / divisor };
            let high = if x_max / divisor > low {
                x_max / divisor
            } else {
                low + 1.0
            };
            let labels = |x: &f64| {
                format!(
                    "{}{}{unit}",
                    trim_decimals(*x),
                    if unit == "%" { "" } else { " " }
                )
            };
            self.draw(&mut svg, low..high, divisor, &labels)?;
        }
        Ok(svg)
    }

    /// The smallest and largest x, after checking every point.
    fn x_extent(&self) -> Result<(f64, f64), PlotError> {
        let mut extent: Option<(f64, f64)> = None;
        for series in &self.series {
            for &(x, y) in &series.points {
                if !x.is_finite() || !y.is_finite() {
                    return Err(PlotError::NotFinite {
                        series: series.name.clone(),
                        x,
                        y,
                    });
                }
                if self.log_x && x <= 0.0 {
                    return Err(PlotError::NotPositive {
                        series: series.name.clone(),
                        x,
                    });
                }
                extent = Some(extent.map_or((x, x), |(lo, hi)| (lo.min(x), hi.max(x))));
            }
        }
        extent.ok_or(PlotError::Empty)
    }

    fn x_label(&self, x: f64) -> String {
        match self.x {
            SizeAxis::Bytes => format_bytes(x),
            SizeAxis::PercentOfFootprint => format!("{x}%"),
        }
    }

    /// Draws with x values divided by `divisor` (the unit `x_label` prints them in).
    fn draw<X>(
        &self,
        svg: &mut String,
        x_range: X,
        divisor: f64,
        x_label: &dyn Fn(&f64) -> String,
    ) -> Result<(), PlotError>
    where
        X: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64>,
    {
        let draw_error = |e: &dyn std::fmt::Display| PlotError::Draw(e.to_string());
        let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| draw_error(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, (FONT, 26))
            .margin(20)
            .x_label_area_size(56)
            .y_label_area_size(72)
            .build_cartesian_2d(x_range, 0f64..1f64)
            .map_err(|e| draw_error(&e))?;
        let (x_desc, y_desc) = (
            match self.x {
                SizeAxis::Bytes => "cache size",
                SizeAxis::PercentOfFootprint => "cache size (% of footprint)",
            },
            match self.y {
                RatioAxis::HitRatio => "hit ratio",
                RatioAxis::MissRatio => "miss ratio",
            },
        );
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(x_label)
            .y_label_formatter(&|y| format!("{y:.1}"))
            .label_style((FONT, 16))
            .axis_desc_style((FONT, 18))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(200, 200, 200))
            .draw()
            .map_err(|e| draw_error(&e))?;
        for (index, series) in self.series.iter().enumerate() {
            let style = COLOURS[index % COLOURS.len()].stroke_width(2);
            chart
                .draw_series(LineSeries::new(
                    series.points.iter().map(|&(x, y)| (x / divisor, y)),
                    style,
                ))
                .map_err(|e| draw_error(&e))?
                .label(series.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
        // Hit ratios rise with size and miss ratios fall: keep the legend off the lines' end.
        let corner = match self.y {
            RatioAxis::HitRatio => SeriesLabelPosition::LowerRight,
            RatioAxis::MissRatio => SeriesLabelPosition::UpperRight,
        };
        chart
            .configure_series_labels()
            .position(corner)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(160, 160, 160))
            .draw()
            .map_err(|e| draw_error(&e))?;
        root.present().map_err(|e| draw_error(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(log_x: bool) -> LineChart {
        let curve = |name: &str, scale: f64| Series {
            name: name.into(),
            points: (1..=8)
                .map(|i| {
                    let size = f64::from(1u32 << i) * (1 << 30) as f64;
                    (size, 1.0 - scale / f64::from(i))
                })
                .collect(),
        };
        LineChart {
            title: "P3 & <friends>".into(),
            x: SizeAxis::Bytes,
            y: RatioAxis::HitRatio,
            log_x,
            series: vec![curve("lru", 0.9), curve("arc \"tuned\"", 0.7)],
        }
    }

    #[test]
    fn svg_parses_and_names_every_series() {
        for log_x in [false, true] {
            let svg = chart(log_x).to_svg().expect("draws");
            let document = roxmltree::Document::parse(&svg).expect("well-formed XML");
            assert_eq!(document.root_element().tag_name().name(), "svg");
            let texts: Vec<&str> = document
                .descendants()
                .filter(|n| n.has_tag_name("text"))
                .filter_map(|n| n.text())
                .map(str::trim)
                .collect();
            let size_label = if log_x { "64 GiB" } else { "200 GiB" };
            for name in [
                "lru",
                "arc \"tuned\"",
                "P3 & <friends>",
                "hit ratio",
                size_label,
            ] {
                assert!(texts.contains(&name), "{name:?} missing from {texts:?}");
            }
            let lines = document
                .descendants()
                .filter(|n| n.has_tag_name("polyline"))
                .count();
            assert!(lines >= 2, "{lines} polylines");
        }
    }

    #[test]
    fn percent_axis_labels_carry_the_unit() {
        let chart = LineChart {
            title: "mrc".into(),
            x: SizeAxis::PercentOfFootprint,
            y: RatioAxis::MissRatio,
            log_x: false,
            series: vec![Series {
                name: "exact".into(),
                points: vec![(1.0, 0.9), (50.0, 0.4), (100.0, 0.1)],
            }],
        };
        let svg = chart.to_svg().expect("draws");
        let document = roxmltree::Document::parse(&svg).expect("well-formed XML");
        let has_text = |t: &str| {
            document
                .descendants()
                .any(|n| n.text().map(str::trim) == Some(t))
        };
        assert!(has_text("100%"));
        assert!(has_text("miss ratio"));
    }

    #[test]
    fn bad_input_is_refused() {
        let mut empty = chart(false);
        empty.series.clear();
        assert_eq!(empty.to_svg(), Err(PlotError::Empty));
        let mut nan = chart(false);
        nan.series[1].points[3].1 = f64::NAN;
        assert!(
            matches!(nan.to_svg(), Err(PlotError::NotFinite { series, .. }) if series == "arc \"tuned\"")
        );
        let mut zero = chart(true);
        zero.series[0].points[0].0 = 0.0;
        assert!(matches!(zero.to_svg(), Err(PlotError::NotPositive { .. })));
    }

    #[test]
    fn bytes_read_in_binary_units() {
        assert_eq!(format_bytes(512.0), "512 B");
        assert_eq!(format_bytes(4096.0), "4 KiB");
        assert_eq!(format_bytes(1.5 * (1u64 << 30) as f64), "1.5 GiB");
        assert_eq!(format_bytes((1u64 << 40) as f64), "1 TiB");
        assert_eq!(format_bytes(0.0), "0 B");
    }
}
