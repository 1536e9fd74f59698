//! The two plots beside `docs/benchmarks.md`, as SVG (plotters, no font files needed).

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

use super::Results;

/// Kernel bandwidth against hidden size (the `sweep/` groups): one line per op and provider.
pub(crate) fn kernel_sweep(results: &Results, path: &Path) -> anyhow::Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for group in results.groups("sweep/") {
        // sweep/<op>/<dtype>/<T>x<H>
        let parts: Vec<&str> = group.split('/').collect();
        let [_, op, dtype, shape] = parts.as_slice() else { continue };
        let Some(hidden) = shape.split('x').nth(1).and_then(|h| h.parse::<f64>().ok()) else { continue };
        for ((g, provider), m) in &results.measurements {
            if g != &group {
                continue;
            }
            let Some(gbps) = m.gb_per_s() else { continue };
            let label = format!("{op} {dtype} {provider}");
            match series.iter_mut().find(|(l, _)| *l == label) {
                Some((_, points)) => points.push((hidden, gbps)),
                None => series.push((label, vec![(hidden, gbps)])),
            }
        }
    }
    for (_, points) in &mut series {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    line_chart(
        path,
        "Kernel bandwidth vs hidden size (bf16, 16M elements per activation)",
        "hidden size H",
        "GB/s (R95 bytes / median time)",
        &series,
    )
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
