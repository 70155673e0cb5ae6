#include "render.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <vector>

namespace dbuf::ctl {
namespace {

using nlohmann::json;

/// `value[key]` as text: strings as they are, numbers and booleans printed,
/// anything missing as "?".
std::string field(const json& value, const char* key) {
  if (!value.is_object() || !value.contains(key)) return "?";
  const json& item = value[key];
  if (item.is_string()) return item.get<std::string>();
  if (item.is_boolean()) return item.get<bool>() ? "yes" : "no";
  if (item.is_null()) return "-";
  return item.dump();
}

double number(const json& value, const char* key) {
  if (!value.is_object() || !value.contains(key) || !value[key].is_number()) return 0;
  return value[key].get<double>();
}

std::string secondsText(double seconds) {
  char text[32];
  if (seconds < 1e-3) {
    std::snprintf(text, sizeof text, "%.0f us", seconds * 1e6);
  } else if (seconds < 1) {
    std::snprintf(text, sizeof text, "%.1f ms", seconds * 1e3);
  } else if (seconds < 60) {
    std::snprintf(text, sizeof text, "%.1f s", seconds);
  } else if (seconds < 3600) {
    std::snprintf(text, sizeof text, "%dm %02ds", static_cast<int>(seconds / 60), static_cast<int>(seconds) % 60);
  } else {
    std::snprintf(text, sizeof text, "%dh %02dm", static_cast<int>(seconds / 3600),
                  static_cast<int>(seconds / 60) % 60);
  }
  return text;
}

/// Rows printed in columns as wide as their widest cell, two spaces apart.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  [[nodiscard]] std::string text(const std::string& indent) const {
    std::vector<std::size_t> widths;
    for (const auto& row : rows_) {
      widths.resize(std::max(widths.size(), row.size()));
      for (std::size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line = indent;
      for (std::size_t c = 0; c < row.size(); ++c) {
        line += row[c];
        if (c + 1 < row.size()) line += std::string(widths[c] - row[c].size() + 2, ' ');
      }
      out += line + "\n";
    }
    return out;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

/// "#12 all_gather of layers.3: waiting for ranks 2, 3 (1.2 s)".
std::string opText(const json& op) {
  if (!op.is_object()) return "-";
  std::string text = "#" + field(op, "sequence") + " " + field(op, "op");
  if (const std::string group = field(op, "group"); !group.empty() && group != "?") text += " of " + group;
  const std::string state = field(op, "state");
  const json waiting = op.value("waiting_for", json::array());
  if (state == "waiting for ranks" && waiting.is_array() && !waiting.empty()) {
    text += std::string(": waiting for ") + (waiting.size() == 1 ? "rank " : "ranks ") + rankList(waiting);
  } else {
    text += ": " + state;
  }
  return text + " (" + secondsText(number(op, "waiting_seconds")) + ")";
}

std::string scopeNote(const json& answer) {
  const std::string scope = field(answer, "scope");
  if (scope == "everything" || scope == "?") return "";
  return "(you see " + scope + " only)\n";
}

}  // namespace

std::string bytesText(double bytes) {
  constexpr std::array<const char*, 5> kUnits{"B", "KiB", "MiB", "GiB", "TiB"};
  std::size_t unit = 0;
  while (bytes >= 1024 && unit + 1 < kUnits.size()) {
    bytes /= 1024;
    ++unit;
  }
  char text[32];
  const bool whole = unit == 0 || bytes >= 100 || bytes == std::floor(bytes);
  std::snprintf(text, sizeof text, whole ? "%.0f %s" : "%.1f %s", bytes, kUnits[unit]);
  return text;
}

std::string rankList(const json& ranks) {
  if (!ranks.is_array()) return "?";
  std::vector<long long> values;
  for (const json& r : ranks) {
    if (r.is_number_integer()) values.push_back(r.get<long long>());
  }
  std::string out;
  for (std::size_t i = 0; i < values.size();) {
    std::size_t j = i;
    while (j + 1 < values.size() && values[j + 1] == values[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(values[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(values[j]);
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

std::string renderStatus(const json& answer) {
  const json& daemon = answer.value("daemon", json::object());
  char instance[32];
  std::snprintf(instance, sizeof instance, "%016llx", static_cast<unsigned long long>(number(daemon, "instance_id")));
  std::ostringstream out;
  out << "dbufd " << (daemon.contains("instance_id") ? instance : "?") << " (pid " << field(daemon, "pid") << ", up "
      << secondsText(number(daemon, "uptime_seconds")) << "), backend " << field(daemon, "backend") << ", protocol "
      << field(daemon, "protocol_version") << "\n"
      << "build:    " << field(daemon, "version") << ", commit " << field(daemon, "commit") << "\n"
      << "socket:   " << field(daemon, "socket") << "\n";
  if (daemon.contains("memory_used_bytes")) {
    out << "memory:   " << bytesText(number(daemon, "memory_used_bytes")) << " used of "
        << bytesText(number(daemon, "memory_limit_bytes")) << "\n";
  }
  if (const std::string url = daemon.value("metrics_url", std::string()); !url.empty()) {
    out << "metrics:  " << url << "\n";
  } else if (const std::string error = daemon.value("metrics_error", std::string()); !error.empty()) {
    out << "metrics:  not served: " << error << "\n";
  }
  out << "state:    " << (daemon.value("draining", false) ? "draining: no new jobs, stops when the running ones end"
                                                           : "serving")
      << "\n"
      << scopeNote(answer) << "\n";
  Table tenants({"TENANT", "MEMORY USED", "QUOTA", "JOBS"});
  for (const json& tenant : answer.value("tenants", json::array())) {
    tenants.add({field(tenant, "name"), bytesText(number(tenant, "memory_used_bytes")),
                 bytesText(number(tenant, "memory_quota_bytes")),
                 field(tenant, "jobs") + " / " + field(tenant, "max_jobs")});
  }
  out << tenants.text("");
  const json& jobs = answer.value("jobs", json::object());
  out << "\njobs:     " << field(jobs, "count");
  std::string states;
  const json by_state = jobs.value("by_state", json::object());  // items() does not keep a temporary alive
  for (const auto& [state, count] : by_state.items()) {
    states += (states.empty() ? "" : ", ") + count.dump() + " " + state;
  }
  if (!states.empty()) out << " (" << states << ")";
  out << "\nsessions: " << field(answer, "sessions") << "\n";
  return out.str();
}

std::string renderJobs(const json& answer) {
  const json& jobs = answer.value("jobs", json::array());
  if (jobs.empty()) return "no jobs\n" + scopeNote(answer);
  Table table({"JOB", "TENANT", "STATE", "RANKS", "GROUPS", "MEMORY", "OPS DONE", "CURRENT OP"});
  for (const json& job : jobs) {
    table.add({field(job, "id"), field(job, "tenant"), field(job, "state"),
               field(job, "attached_ranks") + "/" + field(job, "local_ranks"), field(job, "groups"),
               bytesText(number(job, "memory_bytes")), field(job, "collectives_completed"),
               opText(job.value("current_op", json()))});
  }
  return table.text("") + scopeNote(answer);
}

std::string renderJob(const json& answer) {
  const json& job = answer.value("job", json::object());
  std::ostringstream out;
  const auto first = static_cast<long long>(number(job, "first_rank"));
  const auto local = static_cast<long long>(number(job, "local_ranks"));
  out << "job " << field(job, "id") << " (tenant " << field(job, "tenant") << "): " << field(job, "state") << "\n"
      << "  world size " << field(job, "world_size") << "; ranks " << first;
  if (local > 1) out << "-" << first + local - 1;
  out << " on this node; placement " << field(job, "placement") << "; persistent " << field(job, "persistent") << "\n"
      << "  memory " << bytesText(number(job, "memory_bytes")) << "; collectives completed "
      << field(job, "collectives_completed") << "\n"
      << "  current op: " << opText(job.value("current_op", json())) << "\n\nranks:\n";
  Table ranks({"RANK", "STATE", "SESSION", "PID", "UID", "DEVICE", "QUEUED OPS", "SLOTS"});
  for (const json& rank : job.value("ranks", json::array())) {
    const std::string state = rank.value("attached", false) ? "attached" : rank.value("gone", false) ? "gone" : "-";
    ranks.add({field(rank, "rank"), state, field(rank, "session"), field(rank, "pid"), field(rank, "uid"),
               number(rank, "device") < 0 ? "-" : field(rank, "device"), field(rank, "queued_ops"),
               bytesText(number(rank, "slot_bytes"))});
  }
  out << ranks.text("  ") << "\ngroups:\n";
  Table groups({"GROUP", "ID", "TENSORS", "ELEMENTS", "PADDING", "SHARD/RANK", "DTYPES"});
  for (const json& group : job.value("groups", json::array())) {
    groups.add({field(group, "name"), field(group, "id"), field(group, "tensors"), field(group, "numel"),
                field(group, "padding_elems"), bytesText(number(group, "shard_bytes")),
                field(group, "sharded_dtype") + " / " + field(group, "unsharded_dtype")});
  }
  out << groups.text("  ");
  for (const json& registration : job.value("registrations", json::array())) {
    out << "\nregistration of group " << field(registration, "group") << ": registered by "
        << rankList(registration.value("registered", json())) << "; waiting for "
        << rankList(registration.value("waiting_for", json())) << "\n";
  }
  return out.str() + scopeNote(answer);
}

std::string renderSessions(const json& answer) {
  Table table({"SESSION", "KIND", "PID", "UID", "GID", "JOB", "RANK", "AGE"});
  for (const json& session : answer.value("sessions", json::array())) {
    const bool rank = field(session, "kind") == "rank";
    table.add({field(session, "id"), field(session, "kind"), field(session, "pid"), field(session, "uid"),
               field(session, "gid"), rank ? field(session, "job") : "-", rank ? field(session, "rank") : "-",
               secondsText(number(session, "age_seconds"))});
  }
  return table.text("") + scopeNote(answer);
}

std::string renderTrace(const json& answer) {
  const json& ops = answer.value("ops", json::array());
  if (ops.empty()) return "job " + field(answer, "job") + ": no collective has ended yet\n";
  Table table({"SEQ", "OP", "GROUP", "BYTES", "RESULT", "WAIT", "RUN", "LAST TO SUBMIT"});
  for (const json& op : ops) {
    // The wait is the longest of this node's ranks': from the first submission.
    double first = number(op, "start_seconds");
    double last = 0;
    std::string late = "-";
    for (const json& rank : op.value("ranks", json::array())) {
      if (!rank.contains("submitted_seconds") || !rank["submitted_seconds"].is_number()) {
        late = "rank " + field(rank, "rank") + " never";
        last = number(op, "start_seconds");
        continue;
      }
      const double at = rank["submitted_seconds"].get<double>();
      first = std::min(first, at);
      if (at >= last && late.find("never") == std::string::npos) {
        last = at;
        late = "rank " + field(rank, "rank");
      }
    }
    const std::string result = field(op, "result");
    table.add({field(op, "sequence"), field(op, "op"), field(op, "group").empty() ? "-" : field(op, "group"),
               bytesText(number(op, "unsharded_bytes")), result == "ok" ? "ok" : result + ": " + field(op, "error"),
               secondsText(number(op, "start_seconds") - first),
               secondsText(number(op, "end_seconds") - number(op, "start_seconds")), late});
  }
  return "job " + field(answer, "job") + ", last " + std::to_string(ops.size()) + " collective(s):\n" +
         table.text("") + scopeNote(answer);
}

json chromeTrace(const json& answer) {
  // Rank R is thread R + 1: Perfetto's trace processor reads a tid of 0 as
  // the process's main thread (tid = pid), which put rank 0's events on rank
  // 1's track (tests/trace checks the file with it).
  constexpr int kPid = 1;
  const auto micros = [](double seconds) { return seconds * 1e6; };
  json events = json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", kPid}, {"args", {{"name", "job " + field(answer, "job")}}}});
  json named = json::object();
  // A rank's wait starts at its submission or at the end of the job's
  // previous op, whichever is later: an op submitted while the previous one
  // ran was queued behind it, not waiting for the other ranks (the data
  // plane's timeout counts the same way). Its submission stays in the args.
  // So a rank's phases follow each other on its track: Perfetto drops
  // complete events that overlap without nesting.
  double previous_end = 0;
  for (const json& op : answer.value("ops", json::array())) {
    const std::string name = "#" + field(op, "sequence") + " " + field(op, "op") +
                             (field(op, "group").empty() ? "" : " " + field(op, "group"));
    const json args = {{"sequence", op.value("sequence", 0)},     {"group", op.value("group", "")},
                       {"unsharded_bytes", op.value("unsharded_bytes", 0)}, {"result", op.value("result", "")},
                       {"error", op.value("error", "")}};
    const double start = number(op, "start_seconds");
    const double end = number(op, "end_seconds");
    for (const json& rank : op.value("ranks", json::array())) {
      const int rank_number = rank.value("rank", 0);
      const int tid = rank_number + 1;
      if (!named.contains(std::to_string(tid))) {
        named[std::to_string(tid)] = true;
        events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", kPid}, {"tid", tid},
                          {"args", {{"name", "rank " + std::to_string(rank_number)}}}});
      }
      if (rank.contains("submitted_seconds") && rank["submitted_seconds"].is_number()) {
        const double submitted = rank["submitted_seconds"].get<double>();
        const double waited_from = std::min(std::max(submitted, previous_end), start);
        json wait_args = args;
        wait_args["submitted_us"] = micros(submitted);
        events.push_back({{"ph", "X"}, {"cat", "wait"}, {"name", "wait " + name}, {"pid", kPid}, {"tid", tid},
                          {"ts", micros(waited_from)}, {"dur", micros(start - waited_from)}, {"args", wait_args}});
      }
      events.push_back({{"ph", "X"}, {"cat", "run"}, {"name", name}, {"pid", kPid}, {"tid", tid}, {"ts", micros(start)},
                        {"dur", micros(std::max(0.0, end - start))}, {"args", args}});
    }
    previous_end = std::max(previous_end, end);
  }
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
}

std::string renderDrain(const json& answer) {
  const json& waiting = answer.value("waiting_for_jobs", json::array());
  if (waiting.empty()) return "dbufd is draining: no job has a rank attached; it stops now\n";
  std::string jobs;
  for (const json& job : waiting) jobs += (jobs.empty() ? "" : ", ") + job.get<std::string>();
  return "dbufd is draining: it takes no new jobs and stops once " + std::to_string(waiting.size()) +
         " job(s) end: " + jobs + "\n";
}

}  // namespace dbuf::ctl
