//! The plots beside `docs/benchmarks.md`, as SVG (plotters, no font files needed): one bandwidth
//! plot per op and the pass time per node.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

use super::Results;

/// One plot per op of the `sweep/` groups (the ops the results hold, so a new op gets its plot
/// without being named here): each provider's bandwidth as a share of the same-run copy of the
/// same bytes (the copy is the 100% ceiling line), against the hidden size, every measured hidden
/// size labelled, the legend beside the plot. Returns `(op, file name)` of each plot written into
/// `dir` (`kernel-bandwidth-<op>.svg`).
pub(crate) fn kernel_sweeps(results: &Results, dir: &Path) -> anyhow::Result<Vec<(String, String)>> {
    type Series = BTreeMap<String, Vec<(f64, f64)>>;
    let mut ops: BTreeMap<String, (Series, Vec<f64>)> = BTreeMap::new();
    for group in results.groups("sweep/") {
        // sweep/<op>/<dtype>/<T>x<H>
        let parts: Vec<&str> = group.split('/').collect();
        let [_, op, _, shape] = parts.as_slice() else { continue };
        let Some(hidden) = shape.split('x').nth(1).and_then(|h| h.parse::<f64>().ok()) else { continue };
        let Some(copy) = results.measurements.get(&(group.clone(), "copy".to_owned())).and_then(|m| m.gb_per_s())
        else {
            continue;
        };
        let (series, sizes) = ops.entry((*op).to_owned()).or_default();
        if !sizes.contains(&hidden) {
            sizes.push(hidden);
        }
        for ((g, provider), m) in &results.measurements {
            if g != &group || provider == "copy" {
                continue;
            }
            let Some(gbps) = m.gb_per_s() else { continue };
            series.entry(provider.clone()).or_default().push((hidden, 100.0 * gbps / copy));
        }
    }
    let mut written = Vec::new();
    for (op, (series, mut sizes)) in ops {
        sizes.sort_by(f64::total_cmp);
        let mut series: Vec<(String, Vec<(f64, f64)>)> = series.into_iter().collect();
        for (_, points) in &mut series {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let file = format!("kernel-bandwidth-{op}.svg");
        let title = format!("{op}: bandwidth as a share of the same-run copy (bf16, 16M elements per activation)");
        share_chart(&dir.join(&file), &title, &sizes, &series)?;
        written.push((op, file));
    }
    Ok(written)
}

/// A chart of shares of the copy (%) against hidden sizes on a log axis labelled at exactly
/// `sizes`, with the 100% copy ceiling drawn, and the legend in its own column on the right.
fn share_chart(path: &Path, title: &str, sizes: &[f64], series: &[(String, Vec<(f64, f64)>)]) -> anyhow::Result<()> {
    let err = |e: &dyn std::fmt::Debug| anyhow::anyhow!("{e:?}");
    let (x_min, x_max) = match (sizes.first(), sizes.last()) {
        (Some(&a), Some(&b)) => (a, b),
        _ => (1.0, 10.0),
    };
    let y_max = series.iter().flat_map(|(_, p)| p.iter().map(|&(_, y)| y)).fold(110f64, f64::max) * 1.08;
    let root = SVGBackend::new(path, (1100, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (plot_area, legend_area) = root.split_horizontally(760);
    let x_range = (x_min / 1.25..x_max * 1.25).log_scale().with_key_points(sizes.to_vec());
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(title, ("sans-serif", 15))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(x_range, 0f64..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("hidden size H")
        .y_desc("% of the same-run copy")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    let ceiling = [(x_min / 1.25, 100.0), (x_max * 1.25, 100.0)];
    chart.draw_series(LineSeries::new(ceiling, BLACK.stroke_width(2))).map_err(|e| err(&e))?;
    let mut entries = vec![("copy (same run): the ceiling".to_owned(), BLACK.to_rgba())];
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart.draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2))).map_err(|e| err(&e))?;
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| err(&e))?;
        entries.push((label.clone(), color));
    }
    for (i, (label, color)) in entries.iter().enumerate() {
        let y = 50 + 22 * i as i32;
        legend_area.draw(&PathElement::new(vec![(10, y), (40, y)], color.stroke_width(2))).map_err(|e| err(&e))?;
        legend_area.draw(&Text::new(label.as_str(), (48, y - 7), ("sans-serif", 13))).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e)).with_context(|| format!("writing {}", path.display()))
}

/// Pipeline time per node against graph size (the `passes/pipeline` group).
pub(crate) fn passes(results: &Results, path: &Path) -> anyhow::Result<()> {
    let mut points: Vec<(f64, f64)> = results
        .measurements
        .iter()
        .filter(|((g, _), _)| g == "passes/pipeline")
        .filter_map(|(_, m)| m.per_iteration.map(|nodes| (nodes as f64, m.median_ns / nodes as f64)))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let series = vec![("standard pipeline, verified after each pass".to_owned(), points)];
    line_chart(path, "Pass pipeline time per node vs graph size", "nodes", "ns per node", &series)
}

fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> anyhow::Result<()> {
    let all = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x_min, mut x_max, mut y_max) = (f64::MAX, f64::MIN, 0f64);
    for &(x, y) in all {
        x_min = x_min.min(x);
        x_max = x_max.max(x);
        y_max = y_max.max(y);
    }
    if x_min > x_max {
        // Nothing measured: an empty chart over a nominal range says so better than no file.
        (x_min, x_max, y_max) = (1.0, 10.0, 1.0);
    }
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((x_min / 1.2..x_max * 1.2).log_scale(), 0f64..y_max * 1.15)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    for (i, (label, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::MiddleRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e:?}")).with_context(|| format!("writing {}", path.display()))
}
