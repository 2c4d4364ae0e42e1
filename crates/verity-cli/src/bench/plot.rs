//! PNG plots of the bench records: `--plot DIR` on `bench speed`, `conversation` and `rowcost`, and
//! `verity bench plot` for saved `--json` records. A plot draws only the figures its command prints from the
//! same records (the summary's medians and ratios, rowcost's `widths`), so it never shows a number the JSON
//! lacks. Text is drawn with DejaVu Sans (Bitstream Vera license; DejaVu changes public domain), embedded in
//! the binary so that a machine without system fonts draws the same image.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use serde_json::Value;

use super::conversation;
use super::rowcost::Cost;
use super::summary::{self, Record};

const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");
const SIZE: (u32, u32) = (800, 500);
/// Series colors: gray first (for `ar`), then distinct hues.
const COLORS: [RGBColor; 6] = [
    RGBColor(128, 128, 128),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

#[derive(clap::Args)]
pub struct Args {
    /// Records that `bench speed`, `bench conversation` or `bench rowcost` wrote with `--json`; for rowcost
    /// also several runs merged under keys (`{"run1": {...}, "run2": {...}}`), one line per key.
    #[arg(long)]
    json: PathBuf,
    /// Folder for the PNG (created if missing).
    #[arg(long, value_name = "DIR")]
    plot: PathBuf,
    /// File name of the PNG without `.png` (default: speed, conversation or rowcost).
    #[arg(long)]
    name: Option<String>,
}

/// What a saved JSON file holds.
enum Saved {
    Speed(Vec<Record>),
    Conversation(Vec<Record>),
    /// One line per run: its label and its widths.
    RowCost(Vec<(String, Vec<Cost>)>),
}

pub fn main(a: Args) -> Result<()> {
    let text = std::fs::read_to_string(&a.json)
        .with_context(|| format!("reading {}", a.json.display()))?;
    let source = a.json.file_stem().map_or_else(
        || a.json.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let saved = serde_json::from_str(&text)
        .map_err(anyhow::Error::from)
        .and_then(|value| parse(value, &source))
        .with_context(|| format!("reading {}", a.json.display()))?;
    let kind = match &saved {
        Saved::Speed(_) => "speed",
        Saved::Conversation(_) => "conversation",
        Saved::RowCost(_) => "rowcost",
    };
    let path = png_path(&a.plot, a.name.as_deref().unwrap_or(kind))?;
    match &saved {
        Saved::Speed(records) => speed(records, &source, &path)?,
        Saved::Conversation(records) => conversation(records, &source, &path)?,
        Saved::RowCost(runs) => rowcost(runs, &source, &path)?,
    }
    println!("{}", path.display());
    Ok(())
}

fn parse(value: Value, source: &str) -> Result<Saved> {
    #[derive(Deserialize)]
    struct Run {
        widths: Vec<Cost>,
    }
    match value {
        Value::Array(_) => {
            let records: Vec<Record> =
                serde_json::from_value(value).context("not a list of bench records")?;
            if records.is_empty() {
                bail!("no records");
            }
            // Only `bench conversation` records name their prefix-cache arm.
            Ok(if records.iter().any(|r| r.cache.is_some()) {
                Saved::Conversation(records)
            } else {
                Saved::Speed(records)
            })
        }
        Value::Object(map) if map.contains_key("widths") => {
            let run: Run = serde_json::from_value(Value::Object(map))?;
            Ok(Saved::RowCost(vec![(source.to_string(), run.widths)]))
        }
        Value::Object(map) if !map.is_empty() => {
            let runs = map
                .into_iter()
                .map(|(key, v)| {
                    let run: Run = serde_json::from_value(v)
                        .with_context(|| format!("key {key:?} is not a rowcost run"))?;
                    Ok((key, run.widths))
                })
                .collect::<Result<_>>()?;
            Ok(Saved::RowCost(runs))
        }
        _ => bail!("neither bench records (a list) nor rowcost output (an object with `widths`)"),
    }
}

/// A model for a plot's title: its file or folder name when given as a path.
pub fn model_title(model: &str) -> String {
    Path::new(model)
        .file_name()
        .map_or(model.to_string(), |n| n.to_string_lossy().into_owned())
}

/// `DIR/NAME.png`, the folder created first so that an unusable one fails before any work.
pub fn png_path(dir: &Path, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the plot folder {}", dir.display()))?;
    Ok(dir.join(format!("{name}.png")))
}

/// Decode speed by route and category: median tok/s, then the median ratio to `ar` (as `summary::print`
/// prints them).
pub fn speed(records: &[Record], title: &str, path: &Path) -> Result<()> {
    let rows = summary::rows(records);
    let mut routes: Vec<&str> = Vec::new();
    let mut categories: Vec<&str> = Vec::new();
    for row in &rows {
        if !routes.contains(&row.route.as_str()) {
            routes.push(&row.route);
        }
        if !categories.contains(&row.category.as_str()) {
            categories.push(&row.category);
        }
    }
    // `all` last, as BENCHMARKS.md lists it.
    categories.sort_by_key(|&c| (c == "all", c));
    let figure = |route: &str, category: &str, f: fn(&summary::Row) -> Option<f64>| {
        rows.iter()
            .find(|r| r.route == route && r.category == category)
            .and_then(f)
    };
    let series = |f: fn(&summary::Row) -> Option<f64>| -> Vec<Bars> {
        routes
            .iter()
            .enumerate()
            .map(|(i, &route)| Bars {
                name: route.to_string(),
                color: route_color(route, i),
                values: categories.iter().map(|c| figure(route, c, f)).collect(),
            })
            .collect()
    };
    let tok_s = series(|r| Some(r.decode_tok_s));
    let vs_ar: Vec<Bars> = series(|r| r.vs_ar)
        .into_iter()
        .filter(|b| b.name != "ar")
        .collect();
    let entries: Vec<(&str, RGBColor)> = tok_s.iter().map(|b| (b.name.as_str(), b.color)).collect();
    // No ratios without `ar` runs, or without another route: the speeds then take the whole height.
    let has_ratios = vs_ar.iter().any(|b| b.values.iter().any(Option::is_some));
    let title = format!("Decode speed by route and category: {title}");
    draw(path, &title, |area| {
        let area = legend(area, &entries)?;
        let speeds = if has_ratios {
            let (upper, lower) = area.split_vertically(area.dim_in_pixel().1 / 2);
            let ratio = |v: f64| format!("{v:.2}");
            grouped_bars(
                &lower,
                "median ratio to ar",
                &categories,
                &vs_ar,
                Some(1.0),
                Some(&ratio),
            )?;
            upper
        } else {
            area
        };
        grouped_bars(
            &speeds,
            "median decode tok/s",
            &categories,
            &tok_s,
            None,
            None,
        )
    })
}

/// Turn-2 time to first token per prefix-cache arm (as `bench conversation` prints it).
pub fn conversation(records: &[Record], title: &str, path: &Path) -> Result<()> {
    let arms: Vec<_> = conversation::arms(records)
        .into_iter()
        .filter(|a| a.runs > 0)
        .collect();
    let names: Vec<&str> = arms.iter().map(|a| a.cache).collect();
    let bars = Bars {
        name: "turn 2".into(),
        color: COLORS[1],
        values: arms.iter().map(|a| Some(a.ttft2_s * 1e3)).collect(),
    };
    draw(
        path,
        &format!("Prefix cache: turn-2 time to first token: {title}"),
        |area| {
            let ms = |v: f64| format!("{v:.0}");
            grouped_bars(area, "median ms", &names, &[bars], None, Some(&ms))
        },
    )
}

/// Verify cost by width: median ms, and ms(W)/ms(1), one line per run.
pub fn rowcost(runs: &[(String, Vec<Cost>)], title: &str, path: &Path) -> Result<()> {
    if runs.iter().all(|(_, costs)| costs.is_empty()) {
        bail!("no widths to plot");
    }
    let ms: Vec<Line> = lines(runs, |c| c.median_ms);
    let ratio: Vec<Line> = lines(runs, |c| c.ratio_to_w1);
    let entries: Vec<(&str, RGBColor)> = ms.iter().map(|l| (l.name.as_str(), l.color)).collect();
    draw(path, &format!("Verify cost by width: {title}"), |area| {
        let area = legend(area, &entries)?;
        let width = area.dim_in_pixel().0;
        let (left, right) = area.split_horizontally(width / 2);
        by_width(&left, "median ms", &ms)?;
        by_width(&right, "ms(W) / ms(1)", &ratio)
    })
}

/// A linear axis with ticks (and grid lines) exactly at `at`: group centers, or the measured widths.
/// (plotters' own `with_key_points` on an `f64` range loses the label formatter that the mesh needs.)
struct Ticks {
    range: std::ops::Range<f64>,
    at: Vec<f64>,
}

impl Ranged for Ticks {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let share = (v - self.range.start) / (self.range.end - self.range.start);
        limit.0 + (share * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // Bold points only: no lighter grid lines between the ticks.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.at.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.range.clone()
    }
}

/// The same color for a route in every plot; a route without one takes the palette's color at `index`.
fn route_color(route: &str, index: usize) -> RGBColor {
    match route {
        "ar" => COLORS[0],
        "copy" => COLORS[1],
        "draft_model" => COLORS[2],
        "mtp" => COLORS[3],
        "auto" => COLORS[5],
        "drafter" => COLORS[4],
        _ => COLORS[index % COLORS.len()],
    }
}

/// One series of bars: a value (or none) per group.
struct Bars {
    name: String,
    color: RGBColor,
    values: Vec<Option<f64>>,
}

/// One series of points by width.
struct Line {
    name: String,
    color: RGBColor,
    points: Vec<(usize, f64)>,
}

fn lines(runs: &[(String, Vec<Cost>)], f: fn(&Cost) -> f64) -> Vec<Line> {
    runs.iter()
        .enumerate()
        .map(|(i, (name, costs))| Line {
            name: name.clone(),
            color: COLORS[(i + 1) % COLORS.len()],
            points: costs.iter().map(|c| (c.w, f(c))).collect(),
        })
        .collect()
}

/// Draw into a fresh `SIZE` image under a title, and write it to `path` as a PNG.
fn draw(path: &Path, title: &str, body: impl FnOnce(&Area) -> Result<()>) -> Result<()> {
    // Registering again replaces the same face: harmless, and no global state to set up elsewhere.
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow!("the embedded font is not a valid TrueType font"))?;
    let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let area = root.titled(title, ("sans-serif", 18))?;
        body(&area)?;
        root.present()?;
    }
    let mut png = Vec::new();
    let mut encoder = png::Encoder::new(&mut png, SIZE.0, SIZE.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&rgb)?;
    writer.finish()?;
    std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
}

/// Bars grouped by `groups` (one bar per series in each group); `reference` draws a horizontal line at that
/// value, `value_label` writes each bar's value above it.
fn grouped_bars(
    area: &Area,
    y_desc: &str,
    groups: &[&str],
    series: &[Bars],
    reference: Option<f64>,
    value_label: Option<&dyn Fn(f64) -> String>,
) -> Result<()> {
    let top = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .fold(reference.unwrap_or(0.0), |a, &b| a.max(b));
    // Headroom above the tallest bar for its value label.
    let y_max = if top > 0.0 { top * 1.12 } else { 1.0 };
    let centers: Vec<f64> = (0..groups.len()).map(|i| i as f64 + 0.5).collect();
    let mut chart = ChartBuilder::on(area)
        .margin(8)
        .x_label_area_size(22)
        .y_label_area_size(52)
        .build_cartesian_2d(
            Ticks {
                range: 0.0..groups.len() as f64,
                at: centers,
            },
            0.0..y_max,
        )?;
    let group_name = |x: &f64| {
        groups
            .get(x.floor() as usize)
            .map_or(String::new(), |g| g.to_string())
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len())
        .x_label_formatter(&group_name)
        .y_label_formatter(&tick_label)
        .light_line_style(TRANSPARENT)
        .y_desc(y_desc)
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 12))
        .draw()?;
    let slot = 0.8 / series.len().max(1) as f64;
    for (j, s) in series.iter().enumerate() {
        let bars: Vec<(f64, f64)> = s
            .values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.map(|v| (i as f64 + 0.1 + j as f64 * slot, v)))
            .collect();
        let color = s.color;
        chart.draw_series(bars.iter().map(|&(x, v)| {
            Rectangle::new(
                [(x + slot * 0.05, 0.0), (x + slot * 0.95, v)],
                color.filled(),
            )
        }))?;
        if let Some(format) = value_label {
            let style =
                TextStyle::from(("sans-serif", 10)).pos(Pos::new(HPos::Center, VPos::Bottom));
            chart.draw_series(
                bars.iter()
                    .map(|&(x, v)| Text::new(format(v), (x + slot / 2.0, v), style.clone())),
            )?;
        }
    }
    if let Some(r) = reference {
        chart.draw_series(std::iter::once(PathElement::new(
            [(0.0, r), (groups.len() as f64, r)],
            BLACK.stroke_width(1),
        )))?;
    }
    Ok(())
}

/// Lines by width W on a log2 axis (ticks at the measured widths).
fn by_width(area: &Area, y_desc: &str, lines: &[Line]) -> Result<()> {
    let mut widths: Vec<usize> = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|&(w, _)| w))
        .collect();
    widths.sort_unstable();
    widths.dedup();
    let log2 = |w: usize| (w.max(1) as f64).log2();
    let x_max = log2(*widths.last().unwrap_or(&1)).max(1.0);
    let y_max = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|&(_, v)| v))
        .fold(0.0, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(
            Ticks {
                range: -0.25..x_max + 0.25,
                at: widths.iter().map(|&w| log2(w)).collect(),
            },
            0.0..if y_max > 0.0 { y_max } else { 1.0 },
        )?;
    let width_label = |x: &f64| format!("{}", x.exp2().round());
    chart
        .configure_mesh()
        .x_labels(widths.len())
        .x_label_formatter(&width_label)
        .y_label_formatter(&tick_label)
        .light_line_style(TRANSPARENT)
        .x_desc("rows W")
        .y_desc(y_desc)
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 12))
        .draw()?;
    for l in lines {
        let color = l.color;
        let points: Vec<(f64, f64)> = l.points.iter().map(|&(w, v)| (log2(w), v)).collect();
        chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?;
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    Ok(())
}

/// A row of series names and colors across the top of `area`, shared by the charts below it; returns the
/// rest of the area.
fn legend<'a>(area: &Area<'a>, entries: &[(&str, RGBColor)]) -> Result<Area<'a>> {
    let (strip, rest) = area.split_vertically(26);
    let style = TextStyle::from(("sans-serif", 13)).pos(Pos::new(HPos::Left, VPos::Center));
    let (swatch, gap) = (12, 22);
    let text_widths = entries
        .iter()
        .map(|(name, _)| Ok(strip.estimate_text_size(name, &style)?.0 as i32))
        .collect::<Result<Vec<i32>>>()?;
    let total: i32 = text_widths
        .iter()
        .map(|w| swatch + 6 + w + gap)
        .sum::<i32>()
        - gap;
    let mut x = (strip.dim_in_pixel().0 as i32 - total).max(0) / 2;
    let y = strip.dim_in_pixel().1 as i32 / 2;
    for ((name, color), w) in entries.iter().zip(text_widths) {
        strip.draw(&Rectangle::new(
            [(x, y - swatch / 2), (x + swatch, y + swatch / 2)],
            color.filled(),
        ))?;
        strip.draw(&Text::new(
            name.to_string(),
            (x + swatch + 6, y),
            style.clone(),
        ))?;
        x += swatch + 6 + w + gap;
    }
    Ok(rest)
}

/// An axis tick's value without float noise or trailing zeros: 3500, 1.5, 0.25.
fn tick_label(v: &f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}
