// SVG picture of one unit's layout. Rows are ranks, each row the rank's S
// elements left to right, tensors as coloured spans over a hatched background
// (so whatever no tensor covers, the padding, shows hatched). With more ranks
// than rows fit, consecutive ranks are drawn as one band whose bar shows each
// tensor's share of the band in buffer order, padding collected on the right:
// the file stays small (one rect per tensor and band) and stays readable.
//
// Colour is per tensor kind: the tensor's name with the unit's common prefix
// cut and digit runs replaced by '*' (so 256 experts' gate_proj share a hue);
// neighbouring tensors of one kind alternate between two shades.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "dbuf/common/int_math.hpp"
#include "dbuf/plan_io/report.hpp"

namespace dbuf::plan_io {
namespace {

constexpr double kWidth = 1100;
constexpr double kLeft = 96;  // rank labels and the y axis title
constexpr double kPlotWidth = 900;
constexpr double kTop = 64;  // title lines
constexpr double kMaxPlotHeight = 520;
constexpr std::size_t kMaxLegend = 24;
constexpr double kCharWidth = 6.1;  // average glyph width at 11px, for fitting labels

// Tableau 10 without its grey (too close to the padding hatch), then more
// from Tableau 20 / d3: distinct, print-safe. The largest tensor kinds take the first ones.
constexpr const char* kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2",
                                    "#ff9da7", "#9c755f", "#17becf", "#8c564b", "#bcbd22", "#393b79", "#d62728",
                                    "#637939", "#e377c2", "#843c39", "#1f77b4", "#7b4173", "#e7ba52"};
constexpr std::size_t kPaletteSize = sizeof kPalette / sizeof kPalette[0];

std::string num(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.2f", value);
  std::string text = buffer;
  while (text.back() == '0') text.pop_back();
  if (text.back() == '.') text.pop_back();
  return text;
}

std::string fixed(double value, int decimals) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  return buffer;
}

/// 27262976 -> "27.26M": tick labels and titles.
std::string compact(std::int64_t value) {
  const auto v = static_cast<double>(value);
  if (value >= 1'000'000'000) return fixed(v / 1e9, 2) + "G";
  if (value >= 1'000'000) return fixed(v / 1e6, 2) + "M";
  if (value >= 10'000) return fixed(v / 1e3, 1) + "k";
  return std::to_string(value);
}

std::string escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t') out += c;
    }
  }
  return out;
}

std::string truncate(const std::string& text, std::size_t max_chars) {
  if (text.size() <= max_chars) return text;
  return text.substr(0, max_chars - 3) + "...";
}

/// Longest '.'-terminated prefix shared by every name (only with 2+ tensors).
std::size_t commonPrefix(const std::vector<TensorReport>& tensors) {
  if (tensors.size() < 2) return 0;
  std::size_t length = tensors.front().name.size();
  for (const TensorReport& tensor : tensors) {
    const std::string& a = tensors.front().name;
    const std::string& b = tensor.name;
    std::size_t i = 0;
    while (i < length && i < b.size() && a[i] == b[i]) ++i;
    length = i;
  }
  const std::string& first = tensors.front().name;
  while (length > 0 && first[length - 1] != '.') --length;
  for (const TensorReport& tensor : tensors) {
    if (tensor.name.size() <= length) return 0;
  }
  return length;
}

std::string kindOf(const std::string& short_name) {
  std::string out;
  bool in_digits = false;
  for (const char c : short_name) {
    if (c >= '0' && c <= '9') {
      if (!in_digits) out += '*';
      in_digits = true;
    } else {
      out += c;
      in_digits = false;
    }
  }
  return out;
}

struct Rgb {
  int r = 0, g = 0, b = 0;
};

Rgb parseHex(const char* hex) {
  const auto digit = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  return {digit(hex[1]) * 16 + digit(hex[2]), digit(hex[3]) * 16 + digit(hex[4]), digit(hex[5]) * 16 + digit(hex[6])};
}

std::string toHex(Rgb rgb) {
  char buffer[8];
  std::snprintf(buffer, sizeof buffer, "#%02x%02x%02x", rgb.r, rgb.g, rgb.b);
  return buffer;
}

Rgb lighten(Rgb rgb, double amount) {
  const auto mix = [amount](int c) { return static_cast<int>(std::lround(c + (255 - c) * amount)); };
  return {mix(rgb.r), mix(rgb.g), mix(rgb.b)};
}

bool isDark(Rgb rgb) {
  return 0.299 * rgb.r + 0.587 * rgb.g + 0.114 * rgb.b < 150;
}

struct Kind {
  std::string name;
  std::size_t tensors = 0;
  std::int64_t numel = 0;
  std::size_t colour = 0;
};

struct Style {
  std::string fill;
  bool dark = false;
};

/// One coloured span of a row: part of tensor `tensor` from x0 to x1 (pixels).
struct Span {
  std::size_t tensor = 0;
  double x0 = 0;
  double x1 = 0;
  std::int64_t begin = 0;  ///< rank mode: local element range of the tensor
  std::int64_t end = 0;
};

struct Row {
  std::string label;
  std::string title;  ///< tooltip of the row's hatched background
  std::int64_t padding = 0;
  std::int64_t capacity = 0;
  std::vector<Span> spans;
};

}  // namespace

std::size_t largestUnit(const PlanReport& report) noexcept {
  std::size_t best = 0;
  for (std::size_t u = 1; u < report.units.size(); ++u) {
    if (report.units[u].numel > report.units[best].numel) best = u;
  }
  return best;
}

Result<std::string> writePlanSvg(const PlanReport& report, const SvgOptions& options) {
  if (report.units.empty()) return makeError(ErrorCode::kInvalidArgument, "the plan has no units to draw");
  std::size_t index = largestUnit(report);
  if (!options.unit.empty()) {
    const auto it = std::find_if(report.units.begin(), report.units.end(),
                                 [&](const UnitReport& unit) { return unit.name == options.unit; });
    if (it == report.units.end()) return makeError(ErrorCode::kNotFound, "no unit named '" + options.unit + "'");
    index = static_cast<std::size_t>(it - report.units.begin());
  }
  const UnitReport& unit = report.units[index];
  const std::int64_t devices = std::max<std::int64_t>(report.devices, 1);
  const std::int64_t shard = std::max<std::int64_t>(unit.shard_elems, 1);
  const std::int64_t max_rows = std::max<std::int64_t>(options.max_rows, 1);
  const std::int64_t per_row = ceilDiv(devices, max_rows);  // ranks per band (1: a row per rank)
  const std::int64_t row_count = ceilDiv(devices, per_row);
  const bool banded = per_row > 1;

  // Tensor kinds, colours and per-tensor styles.
  const std::size_t prefix = commonPrefix(unit.tensors);
  std::vector<std::string> short_names;
  std::vector<Kind> kinds;
  std::map<std::string, std::size_t> kind_index;
  std::vector<Style> styles;
  std::vector<std::size_t> tensor_kind;
  for (const TensorReport& tensor : unit.tensors) {
    short_names.push_back(tensor.name.substr(prefix));
    const auto [it, inserted] = kind_index.try_emplace(kindOf(short_names.back()), kinds.size());
    if (inserted) kinds.push_back({it->first, 0, 0, 0});
    tensor_kind.push_back(it->second);
    kinds[it->second].numel += tensor.numel;
  }
  // The largest kinds get the first (most distinct) colours; the legend lists
  // kinds largest first, so a truncated legend drops only the smallest.
  std::vector<std::size_t> legend(kinds.size());
  for (std::size_t k = 0; k < kinds.size(); ++k) legend[k] = k;
  std::stable_sort(legend.begin(), legend.end(),
                   [&](std::size_t a, std::size_t b) { return kinds[a].numel > kinds[b].numel; });
  for (std::size_t rank = 0; rank < legend.size(); ++rank) kinds[legend[rank]].colour = rank % kPaletteSize;
  for (const std::size_t k : tensor_kind) {
    Kind& kind = kinds[k];
    const Rgb base = parseHex(kPalette[kind.colour]);
    const Rgb rgb = kind.tensors % 2 == 0 ? base : lighten(base, 0.35);
    styles.push_back({toHex(rgb), isDark(rgb)});
    ++kind.tensors;
  }

  // Tensors in buffer order, for a sweep over the rows.
  std::vector<std::size_t> order(unit.tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return unit.tensors[a].offset < unit.tensors[b].offset; });

  std::vector<Row> rows(static_cast<std::size_t>(row_count));
  std::size_t first_live = 0;  // first tensor (in `order`) that may still reach the current row
  for (std::int64_t r = 0; r < row_count; ++r) {
    Row& row = rows[static_cast<std::size_t>(r)];
    const std::int64_t first_rank = r * per_row;
    const std::int64_t last_rank = std::min(devices, first_rank + per_row) - 1;
    const std::int64_t begin = first_rank * shard;
    const std::int64_t end = (last_rank + 1) * shard;
    row.capacity = end - begin;
    row.label = last_rank > first_rank ? std::to_string(first_rank) + "-" + std::to_string(last_rank)
                                       : std::to_string(first_rank);
    std::int64_t used = 0;
    double x = 0;  // banded: running share
    while (first_live < order.size() &&
           unit.tensors[order[first_live]].offset + unit.tensors[order[first_live]].numel <= begin) {
      ++first_live;
    }
    for (std::size_t k = first_live; k < order.size(); ++k) {
      const TensorReport& tensor = unit.tensors[order[k]];
      if (tensor.offset >= end) break;
      const std::int64_t lo = std::max(begin, tensor.offset);
      const std::int64_t hi = std::min(end, tensor.offset + tensor.numel);
      if (hi <= lo) continue;
      used += hi - lo;
      Span span{order[k], 0, 0, lo - tensor.offset, hi - tensor.offset};
      const double scale = kPlotWidth / static_cast<double>(row.capacity);
      if (banded) {
        span.x0 = x;
        x += static_cast<double>(hi - lo) * scale;
        span.x1 = x;
      } else {
        span.x0 = static_cast<double>(lo - begin) * scale;
        span.x1 = static_cast<double>(hi - begin) * scale;
      }
      row.spans.push_back(span);
    }
    row.padding = row.capacity - used;
    const std::string who = banded ? "ranks " + row.label : "rank " + row.label;
    row.title = who + ": padding " + std::to_string(row.padding) + " of " + std::to_string(row.capacity) +
                " elements (" + fixed(100.0 * static_cast<double>(row.padding) / static_cast<double>(row.capacity), 2) +
                "%)";
  }

  // Geometry.
  const double row_height = std::clamp(std::floor(kMaxPlotHeight / static_cast<double>(row_count)), 6.0, 36.0);
  const double gap = row_height >= 12 ? 3 : 1;
  const double plot_height = row_height * static_cast<double>(row_count);
  const double plot_bottom = kTop + plot_height;
  const double label_every = std::ceil(11.0 / row_height);  // rows between y labels, so labels never collide
  const std::size_t label_step = static_cast<std::size_t>(label_every);
  const bool pad_column = row_height >= 12;

  const std::size_t legend_shown = std::min(kinds.size(), kMaxLegend);
  constexpr std::size_t kLegendColumns = 3;
  const double legend_top = plot_bottom + 76;
  // Whole rows of entries (kinds, then padding), plus one for "... and N more".
  const std::size_t entry_rows = (legend_shown + 1 + kLegendColumns - 1) / kLegendColumns;
  const auto legend_rows = static_cast<double>(entry_rows + (kinds.size() > legend_shown ? 1 : 0));
  const double height = legend_top + legend_rows * 17 + 16;

  std::string out;
  out.reserve(std::size_t{64} * 1024);
  out += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(kWidth) + "\" height=\"" + num(height) +
         "\" viewBox=\"0 0 " + num(kWidth) + " " + num(height) +
         "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"11\">\n";
  out +=
      "<defs><pattern id=\"pad\" patternUnits=\"userSpaceOnUse\" width=\"6\" height=\"6\" "
      "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f2f2f2\"/>"
      "<rect width=\"2\" height=\"6\" fill=\"#a8a8a8\"/></pattern></defs>\n";
  out += "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";

  // Title.
  const double padding_share = 100.0 * static_cast<double>(unit.padding_elems) /
                               static_cast<double>(std::max<std::int64_t>(devices * unit.shard_elems, 1));
  const std::string model = report.model.empty() ? std::string() : report.model + ", ";
  out += "<text x=\"" + num(kLeft) + "\" y=\"20\" font-size=\"15\" font-weight=\"bold\">" +
         escape(model + "unit " + unit.name + ": " + std::to_string(unit.tensors.size()) + " tensors on " +
                std::to_string(devices) + " ranks, granularity " + report.granularity) +
         "</text>\n";
  out += "<text x=\"" + num(kLeft) + "\" y=\"38\">" +
         escape("N = " + std::to_string(unit.numel) + " elements, S = " + std::to_string(unit.shard_elems) +
                " per rank (lower bound " + std::to_string(unit.lower_bound_elems) + "), padding " +
                std::to_string(unit.padding_elems) + " (" + fixed(padding_share, 2) +
                "%), V*S/N = " + fixed(unit.inflation, 4) + "x, split blocks " + std::to_string(unit.split_blocks)) +
         "</text>\n";
  out += "<text x=\"" + num(kLeft) + "\" y=\"54\" fill=\"#555555\">" +
         escape(banded ? "Each row is a band of " + std::to_string(per_row) +
                             " ranks: each tensor's share of the band, in buffer order; padding collected on the right."
                       : "Each row is one rank's shard of S elements; hatched = padding.") +
         "</text>\n";

  // Rows: hatched background, then the spans.
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const Row& row = rows[r];
    const double y = kTop + static_cast<double>(r) * row_height;
    const double h = row_height - gap;
    out += "<rect x=\"" + num(kLeft) + "\" y=\"" + num(y) + "\" width=\"" + num(kPlotWidth) + "\" height=\"" + num(h) +
           "\" fill=\"url(#pad)\"><title>" + escape(row.title) + "</title></rect>\n";
    for (const Span& span : row.spans) {
      const double width = span.x1 - span.x0;
      if (width < 0.02) continue;  // invisible; still in the legend and the tooltips' totals
      const TensorReport& tensor = unit.tensors[span.tensor];
      std::string tip = tensor.name + ": elements [" + std::to_string(span.begin) + ", " + std::to_string(span.end) +
                        ") of " + std::to_string(tensor.numel);
      if (banded) {
        tip += ", " + fixed(100.0 * static_cast<double>(span.end - span.begin) / static_cast<double>(row.capacity), 2) +
               "% of ranks " + row.label;
      } else {
        tip += " on rank " + row.label;
      }
      out += "<rect x=\"" + num(kLeft + span.x0) + "\" y=\"" + num(y) + "\" width=\"" + num(width) + "\" height=\"" +
             num(h) + "\" fill=\"" + styles[span.tensor].fill + "\"><title>" + escape(tip) + "</title></rect>\n";
      const std::string& label = short_names[span.tensor];
      if (h >= 13 && width >= static_cast<double>(label.size()) * kCharWidth + 8) {
        out += "<text x=\"" + num(kLeft + span.x0 + 4) + "\" y=\"" + num(y + h / 2 + 4) + "\" fill=\"" +
               (styles[span.tensor].dark ? "#ffffff" : "#000000") + "\" pointer-events=\"none\">" + escape(label) +
               "</text>\n";
      }
    }
    if (r % label_step == 0) {
      out += "<text x=\"" + num(kLeft - 6) + "\" y=\"" + num(y + h / 2 + 4) + "\" text-anchor=\"end\">" +
             escape(row.label) + "</text>\n";
    }
    if (pad_column) {
      out += "<text x=\"" + num(kLeft + kPlotWidth + 6) + "\" y=\"" + num(y + h / 2 + 4) + "\" fill=\"#555555\">" +
             fixed(100.0 * static_cast<double>(row.padding) / static_cast<double>(row.capacity), 1) + "%</text>\n";
    }
  }
  if (pad_column) {
    out += "<text x=\"" + num(kLeft + kPlotWidth + 6) + "\" y=\"" + num(kTop - 4) + "\" fill=\"#555555\">pad</text>\n";
  }

  // Axes.
  out += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(plot_bottom + 2) + "\" x2=\"" + num(kLeft + kPlotWidth) +
         "\" y2=\"" + num(plot_bottom + 2) + "\" stroke=\"#333333\"/>\n";
  for (int t = 0; t <= 4; ++t) {
    const double x = kLeft + kPlotWidth * t / 4.0;
    out += "<line x1=\"" + num(x) + "\" y1=\"" + num(plot_bottom + 2) + "\" x2=\"" + num(x) + "\" y2=\"" +
           num(plot_bottom + 7) + "\" stroke=\"#333333\"/>\n";
    const std::string tick = banded ? std::to_string(t * 25) + "%" : compact(unit.shard_elems * t / 4);
    const char* anchor = t == 0 ? "start" : (t == 4 ? "end" : "middle");
    out += "<text x=\"" + num(x) + "\" y=\"" + num(plot_bottom + 19) + "\" text-anchor=\"" + anchor + "\">" + tick +
           "</text>\n";
  }
  out += "<text x=\"" + num(kLeft + kPlotWidth / 2) + "\" y=\"" + num(plot_bottom + 36) + "\" text-anchor=\"middle\">" +
         escape(banded ? "share of the band's elements (" + std::to_string(per_row) + " x S)"
                       : "element offset within the rank's shard (S = " + std::to_string(unit.shard_elems) + ")") +
         "</text>\n";
  const double axis_y = kTop + plot_height / 2;
  out += "<text x=\"16\" y=\"" + num(axis_y) + "\" text-anchor=\"middle\" transform=\"rotate(-90 16 " + num(axis_y) +
         ")\">" + (banded ? "ranks (bands of " + std::to_string(per_row) + ")" : std::string("rank")) + "</text>\n";

  // Legend: kinds in order of first appearance, then padding.
  const double column_width = (kWidth - kLeft) / static_cast<double>(kLegendColumns);
  const auto legend_entry = [&](std::size_t slot, const std::string& fill, const std::string& text) {
    const double x = kLeft + column_width * static_cast<double>(slot % kLegendColumns);
    const std::size_t row = slot / kLegendColumns;
    const double y = legend_top + 17 * static_cast<double>(row);
    out += "<rect x=\"" + num(x) + "\" y=\"" + num(y - 10) + "\" width=\"12\" height=\"12\" fill=\"" + fill +
           "\" stroke=\"#666666\" stroke-width=\"0.5\"/>\n";
    out += "<text x=\"" + num(x + 17) + "\" y=\"" + num(y) + "\">" + escape(text) + "</text>\n";
  };
  const auto max_chars = static_cast<std::size_t>((column_width - 24) / kCharWidth);
  const double unit_numel = static_cast<double>(std::max<std::int64_t>(unit.numel, 1));
  for (std::size_t k = 0; k < legend_shown; ++k) {
    const Kind& kind = kinds[legend[k]];
    const double percent = 100.0 * static_cast<double>(kind.numel) / unit_numel;
    const std::string share = percent > 0 && percent < 0.05 ? "<0.1%" : fixed(percent, 1) + "%";
    const std::string suffix = (kind.tensors > 1 ? " x" + std::to_string(kind.tensors) : std::string()) + " " + share;
    const std::size_t room = max_chars > suffix.size() + 4 ? max_chars - suffix.size() : 4;
    legend_entry(k, kPalette[kind.colour], truncate(kind.name, room) + suffix);
  }
  legend_entry(legend_shown, "url(#pad)",
               "padding " + fixed(padding_share, 2) + "% (" + compact(unit.padding_elems) + " elements)");
  if (kinds.size() > legend_shown) {
    const double y = legend_top + 17 * legend_rows - 17;
    out += "<text x=\"" + num(kLeft) + "\" y=\"" + num(y) + "\" fill=\"#555555\">... and " +
           std::to_string(kinds.size() - legend_shown) + " more tensor kinds</text>\n";
  }
  out += "<text x=\"" + num(kLeft) + "\" y=\"" + num(legend_top - 20) + "\" fill=\"#555555\">" +
         escape(prefix > 0 ? "tensors (names after '" + unit.tensors.front().name.substr(0, prefix) +
                                 "'; * = any number), share of N:"
                           : std::string("tensors (* = any number), share of N:")) +
         "</text>\n";
  out += "</svg>\n";
  return out;
}

}  // namespace dbuf::plan_io
