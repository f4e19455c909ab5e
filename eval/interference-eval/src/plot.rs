//! Heat maps of a characterization: one panel per placement and vNPU
//! shape, row = the tenant, column = its neighbour, colour = the row
//! tenant's slowdown.

use plotters::prelude::*;
use thiserror::Error;

use npu_interference::characterize::{Matrix, Placement};
use npu_interference::corun::Spec;

/// Why a plot could not be drawn.
#[derive(Debug, Error)]
#[error("cannot draw {path}: {reason}")]
pub struct PlotError {
    path: String,
    reason: String,
}

/// One panel: its title, the row/column items and slowdown[row][col]
/// (NaN: not measured).
struct Panel {
    title: String,
    /// The largest slowdown measured (the colour scale's top).
    max: f64,
    items: Vec<Spec>,
    slowdown: Vec<Vec<f64>>,
}

fn short(s: &Spec) -> String {
    let w = match s.workload.as_str() {
        "resnet50" => "resnet",
        "efficientnet" => "effnet",
        "transformer" => "transf",
        "mobilenet" => "mobnet",
        w => w,
    };
    format!("{w} b{}", s.batch)
}

fn panels(m: &Matrix) -> Vec<Panel> {
    let mut keys: Vec<(Placement, u32, u32)> = m
        .cases
        .iter()
        .filter(|c| c.tenants.len() == 2)
        .map(|c| (c.placement, c.tenants[0].spec.sa, c.tenants[0].spec.vu))
        .collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|(placement, sa, vu)| {
            let cases: Vec<_> = m
                .cases
                .iter()
                .filter(|c| {
                    c.tenants.len() == 2
                        && c.placement == placement
                        && c.tenants[0].spec.sa == sa
                        && c.tenants[0].spec.vu == vu
                })
                .collect();
            let mut items: Vec<Spec> =
                cases.iter().flat_map(|c| c.tenants.iter().map(|t| t.spec.clone())).collect();
            items.sort_by(|a, b| (&a.workload, a.batch).cmp(&(&b.workload, b.batch)));
            items.dedup();
            let at = |s: &Spec| items.iter().position(|x| x == s).unwrap_or(0);
            let mut slowdown = vec![vec![f64::NAN; items.len()]; items.len()];
            for c in &cases {
                let (a, b) = (&c.tenants[0], &c.tenants[1]);
                slowdown[at(&a.spec)][at(&b.spec)] = a.slowdown;
                slowdown[at(&b.spec)][at(&a.spec)] = b.slowdown;
            }
            let max = slowdown.iter().flatten().copied().filter(|x| x.is_finite()).fold(1.0, f64::max);
            Panel {
                title: format!("{} placement, {sa} SA + {vu} VU each (max {max:.2}x)", placement.name()),
                max,
                items,
                slowdown,
            }
        })
        .collect()
}

/// White at 1x, dark red at `max` (a log scale when `max` is large).
fn colour(x: f64, max: f64) -> RGBColor {
    if !x.is_finite() {
        return RGBColor(200, 200, 200);
    }
    let f = if max > 4.0 { x.max(1.0).ln() / max.ln() } else { (x - 1.0) / (max - 1.0).max(1e-9) };
    let f = f.clamp(0.0, 1.0);
    let lerp = |a: f64, b: f64| (a + (b - a) * f).round() as u8;
    RGBColor(lerp(255.0, 165.0), lerp(255.0, 0.0), lerp(255.0, 38.0))
}

/// Draws every pair panel of `m` into an SVG file at `path`.
pub fn heat_maps(m: &Matrix, path: &str) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError { path: path.to_string(), reason: e.to_string() };
    let panels = panels(m);
    let cols = panels.len().clamp(1, 3);
    let rows = panels.len().div_ceil(cols).max(1);
    let root = SVGBackend::new(path, (640 * cols as u32, 640 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    for (panel, area) in panels.iter().zip(root.split_evenly((rows, cols))) {
        let (n, max) = (panel.items.len() as i32, panel.max);
        let mut chart = ChartBuilder::on(&area)
            .caption(&panel.title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(100)
            .build_cartesian_2d((0..n).into_segmented(), (0..n).into_segmented())
            .map_err(|e| err(&e))?;
        let name = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                panel.items.get(*i as usize).map(short).unwrap_or_default()
            }
            SegmentValue::Last => String::new(),
        };
        // Columns by number (the row of the same number names it).
        let number = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) if (*i as usize) < panel.items.len() => {
                format!("{}", i + 1)
            }
            _ => String::new(),
        };
        let named = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) if (*i as usize) < panel.items.len() => {
                format!("{} ({})", name(v), i + 1)
            }
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(n as usize)
            .y_labels(n as usize)
            .x_label_formatter(&number)
            .y_label_formatter(&named)
            .x_label_style(("sans-serif", 10))
            .y_label_style(("sans-serif", 11))
            .x_desc("neighbour (the row of that number)")
            .y_desc("tenant (its slowdown)")
            .draw()
            .map_err(|e| err(&e))?;
        let cells = panel.slowdown.iter().enumerate().flat_map(|(r, row)| {
            row.iter().enumerate().map(move |(c, &x)| {
                let (r, c) = (r as i32, c as i32);
                Rectangle::new(
                    [
                        (SegmentValue::Exact(c), SegmentValue::Exact(r)),
                        (SegmentValue::Exact(c + 1), SegmentValue::Exact(r + 1)),
                    ],
                    colour(x, max).filled(),
                )
            })
        });
        chart.draw_series(cells).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Draws bar charts into an SVG file at `path`: one panel per series
/// (name, per label `[min, median, max]`), a bar per label from 1 to the
/// median with a whisker from min to max.
pub fn bars(
    path: &str,
    title: &str,
    labels: &[String],
    series: &[(&str, Vec<[f64; 3]>)],
) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError { path: path.to_string(), reason: e.to_string() };
    let n = labels.len() as i32;
    let cols = series.len().max(1);
    let root = SVGBackend::new(path, (90 * n.max(4) as u32 * cols as u32, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(|e| err(&e))?;
    let palette = [RGBColor(31, 119, 180), RGBColor(255, 127, 14)];
    for (k, ((name, values), area)) in series.iter().zip(root.split_evenly((1, cols))).enumerate() {
        let top = values.iter().map(|v| v[2]).filter(|x| x.is_finite()).fold(1.0, f64::max);
        let top = 1.0 + (top - 1.0) * 1.1 + 1e-3;
        let mut chart = ChartBuilder::on(&area)
            .caption(*name, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            // A segmented 0..k has k + 1 segments: 0..n - 1 gives one per label.
            .build_cartesian_2d((0..(n - 1).max(0)).into_segmented(), 1.0..top)
            .map_err(|e| err(&e))?;
        let label = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n as usize)
            .x_label_formatter(&label)
            .x_label_style(("sans-serif", 11))
            .y_desc("slowdown (x solo)")
            .draw()
            .map_err(|e| err(&e))?;
        let colour = palette[k % palette.len()];
        chart
            .draw_series(values.iter().enumerate().map(|(i, v)| {
                let i = i as i32;
                let mut r = Rectangle::new(
                    [(SegmentValue::Exact(i), 1.0), (SegmentValue::Exact(i + 1), v[1])],
                    colour.mix(0.7).filled(),
                );
                r.set_margin(0, 0, 12, 12);
                r
            }))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(values.iter().enumerate().map(|(i, v)| {
                let c = SegmentValue::CenterOf(i as i32);
                PathElement::new(vec![(c.clone(), v[0]), (c, v[2])], BLACK.stroke_width(2))
            }))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
