//! @file psx/transport/cluster_spec.hpp
//! TensorFlow's cluster description (`TF_CONFIG`) for the ZeroMQ transport:
//! which processes make up the cluster and which one this process is.
//! The layout is exactly TensorFlow's:
//! @code
//! {"cluster": {"chief": ["host:port"], "worker": ["host:port", ...], "ps": ["host:port", ...]},
//!  "task": {"type": "worker", "index": 0}}
//! @endcode
//! psx numbers workers chief first: psx worker 0 is the chief when there is
//! one, and TensorFlow's worker `i` is then psx worker `i + 1`. TensorFlow's
//! ps task `s` is psx server `s`.
#pragma once

#include <psx/errors.hpp>

// cereal's JSON archive (checkpoint manifests, export metadata) relies on
// RapidJSON's assertions throwing: it defines RAPIDJSON_ASSERT so, and its
// parse and write flags, unless they are defined already. Had this header
// included RapidJSON first, RapidJSON's defaults won (a plain assert) for the
// whole translation unit: a checkpoint with a field of the wrong type
// aborted the program, or under NDEBUG was read from the wrong bits. Where
// cereal is installed on the system's RapidJSON (Debian's), its archive
// comes first, so RapidJSON is configured alike whichever psx header a
// program includes first. (An upstream cereal bundles a RapidJSON of its
// own in the same namespace, which cannot be included beside the system's.)
#if __has_include(<cereal/archives/json.hpp>) && !__has_include(<cereal/external/rapidjson/rapidjson.h>)
#include <cereal/archives/json.hpp>
#endif

#include <rapidjson/document.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <rapidjson/error/en.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {
// A task address taken apart: "host:port" and "tcp://host:port" give the host
// and the port, "ipc://path" the path; `problem` says why it is none of them.
struct TfAddress {
  bool ipc = false;
  std::string_view host;  // or the ipc path
  std::uint16_t port = 0;
  std::string problem;  // empty: a valid address
};

inline TfAddress parse_tf_address(std::string_view address) {
  TfAddress out;
  constexpr std::string_view ipc = "ipc://";
  constexpr std::string_view tcp = "tcp://";
  if (address.substr(0, ipc.size()) == ipc) {
    out.ipc = true;
    out.host = address.substr(ipc.size());
    if (out.host.empty()) out.problem = "the ipc path is empty";
    return out;
  }
  std::string_view rest = address;
  if (rest.substr(0, tcp.size()) == tcp) rest.remove_prefix(tcp.size());
  if (rest.find("://") != std::string_view::npos) {
    out.problem = "unsupported scheme";
    return out;
  }
  const auto colon = rest.rfind(':');
  if (colon == std::string_view::npos) {
    out.problem = "no \":port\"";
    return out;
  }
  out.host = rest.substr(0, colon);
  const std::string_view port = rest.substr(colon + 1);
  if (out.host.empty()) {
    out.problem = "the host is empty";
    return out;
  }
  for (const char c : out.host) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7F || c == '/') {
      out.problem = "the host contains a space, a control character or a '/'";
      return out;
    }
  }
  if (out.host == "*" || out.host == "0.0.0.0" || out.host == "[::]" || out.host == "[0:0:0:0:0:0:0:0]") {
    out.problem = "the host is \"" + std::string(out.host) +
                  "\" (every interface): a cluster address names the interface the server binds, "
                  "which its workers connect to";
    return out;
  }
  // An IPv6 host has colons of its own and must be bracketed: "[::1]:5555".
  const bool bracketed = out.host.front() == '[' || out.host.back() == ']';
  if (out.host.find(':') != std::string_view::npos && !bracketed) {
    out.problem = "an IPv6 host must be in brackets, as in \"[::1]:5555\"";
    return out;
  }
  if (bracketed) {
    const std::string_view inner =
        out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']' ? out.host.substr(1, out.host.size() - 2)
                                                                              : std::string_view();
    // Hex digits, ':' and '.' (an embedded IPv4 address), then maybe a
    // zone: '%' and an interface's name ("fe80::1%br-lan").
    const std::string_view ip = inner.substr(0, inner.find('%'));
    const std::string_view zone = ip.size() < inner.size() ? inner.substr(ip.size() + 1) : "-";
    bool ok = ip.find(':') != std::string_view::npos && !zone.empty();
    for (const char c : ip) ok = ok && (std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.');
    for (const char c : zone) ok = ok && c != '%' && c != '[' && c != ']';
    if (!ok) {
      out.problem = "the host \"" + std::string(out.host) + "\" is not a bracketed IPv6 address such as \"[::1]\"";
      return out;
    }
    // Every spelling of the unspecified address ("[::0]", "[0::]", ...), not only the two above.
    ::in6_addr a{};
    if (::inet_pton(AF_INET6, std::string(ip).c_str(), &a) == 1 && IN6_IS_ADDR_UNSPECIFIED(&a)) {
      out.problem = "the host is \"" + std::string(out.host) +
                    "\" (every interface): a cluster address names the interface the server binds, "
                    "which its workers connect to";
      return out;
    }
  }
  unsigned long value = 0;
  bool ok = !port.empty();
  for (const char c : port) {
    if (c < '0' || c > '9' || value > 65535) {
      ok = false;
      break;
    }
    value = value * 10 + static_cast<unsigned long>(c - '0');
  }
  if (!ok || value > 65535) {
    out.problem = "the port \"" + std::string(port) + "\" is not a decimal number in [0, 65535]";
    return out;
  }
  out.port = static_cast<std::uint16_t>(value);
  return out;
}

// An address for a message: control characters (a NUL would end the message) as \xNN.
inline std::string shown_address(std::string_view address) {
  std::string shown;
  for (const char c : address) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u != 0x7F) {
      shown += c;
    } else {
      constexpr char hex[] = "0123456789ABCDEF";
      shown += {'\\', 'x', hex[u >> 4], hex[u & 15]};
    }
  }
  return shown;
}

[[noreturn]] inline void throw_bad_tf_address(std::string_view address, const std::string& problem) {
  throw config_error("psx: address \"" + shown_address(address) + "\": " + problem +
                     "; expected \"host:port\", \"tcp://host:port\" or \"ipc://path\"");
}

// What a JSON value is, for "expected X, got Y" messages.
inline const char* tf_json_kind(const rapidjson::Value& v) {
  switch (v.GetType()) {
    case rapidjson::kNullType:
      return "null";
    case rapidjson::kFalseType:
    case rapidjson::kTrueType:
      return "a boolean";
    case rapidjson::kObjectType:
      return "an object";
    case rapidjson::kArrayType:
      return "an array";
    case rapidjson::kStringType:
      return "a string";
    case rapidjson::kNumberType:
      return "a number";
  }
  return "an unknown value";
}

inline std::string tf_json_string(const rapidjson::Value& v) { return std::string(v.GetString(), v.GetStringLength()); }

// The member `key` of `object`, or null when missing; two members of that name
// are refused, since RapidJSON would silently take the first.
inline const rapidjson::Value* tf_member_once(const rapidjson::Value& object, std::string_view key,
                                              std::string_view where, const std::string& path) {
  const rapidjson::Value* found = nullptr;
  for (auto m = object.MemberBegin(); m != object.MemberEnd(); ++m) {
    if (std::string_view(m->name.GetString(), m->name.GetStringLength()) != key) continue;
    if (found) throw config_error("psx: " + std::string(where) + ": " + path + ": given twice; write each key once");
    found = &m->value;
  }
  return found;
}

template <class Writer>
void write_tf_cluster(Writer& w, const std::vector<std::string>& chief, const std::vector<std::string>& worker,
                      const std::vector<std::string>& ps) {
  w.StartObject();
  const auto job = [&w](const char* name, const std::vector<std::string>& addresses) {
    if (addresses.empty()) return;  // TensorFlow lists only the jobs it has
    w.Key(name);
    w.StartArray();
    for (const auto& a : addresses) w.String(a.data(), static_cast<rapidjson::SizeType>(a.size()));
    w.EndArray();
  };
  job("chief", chief);
  job("worker", worker);
  job("ps", ps);
  w.EndObject();
}

template <class Writer>
void write_tf_task(Writer& w, const std::string& type, std::size_t index) {
  w.StartObject();
  w.Key("type");
  w.String(type.data(), static_cast<rapidjson::SizeType>(type.size()));
  w.Key("index");
  w.Uint64(index);
  w.EndObject();
}

inline std::string tf_task_name(const std::string& type, std::size_t index) {
  return "\"" + type + "\" " + std::to_string(index);
}

}  // namespace detail

namespace transport {

//! A ZeroMQ endpoint for a task address: "host:port" -> "tcp://host:port";
//! "tcp://..." and "ipc://..." are kept as they are. Throws `config_error`
//! for anything else.
inline std::string zmq_endpoint(std::string_view address) {
  const auto parsed = detail::parse_tf_address(address);
  if (!parsed.problem.empty()) detail::throw_bad_tf_address(address, parsed.problem);
  if (address.substr(0, 6) == "tcp://" || parsed.ipc) return std::string(address);
  return "tcp://" + std::string(address);
}

//! The port of a "host:port" or "tcp://host:port" address (0: ephemeral, the
//! server binds any free port); `std::nullopt` for an "ipc://" address.
//! Throws `config_error` for anything else.
inline std::optional<std::uint16_t> tcp_port(std::string_view address) {
  const auto parsed = detail::parse_tf_address(address);
  if (!parsed.problem.empty()) detail::throw_bad_tf_address(address, parsed.problem);
  if (parsed.ipc) return std::nullopt;
  return parsed.port;
}

//! Jobs and their task addresses, with TensorFlow's meaning.
struct ClusterSpec {
  //! The chief's address: zero or one.
  std::vector<std::string> chief;
  //! TensorFlow's workers other than the chief, in order.
  std::vector<std::string> worker;
  //! The parameter servers, in order.
  std::vector<std::string> ps;

  //! A cluster of `ps` servers and `workers` workers (the first the chief)
  //! on this host: tcp on 127.0.0.1 with ephemeral ports (port 0: set
  //! `Zmq::rendezvous` to a directory the tasks share), or, when `ipc_dir`
  //! is given, ipc sockets in that directory (`ps-sock-<s>`,
  //! `worker-sock-<w>`). For tests, benchmarks and one-host runs.
  static ClusterSpec local(std::size_t ps, std::size_t workers, const std::filesystem::path& ipc_dir = {}) {
    ClusterSpec c;
    auto address = [&](const std::string& name) {
      return ipc_dir.empty() ? std::string("127.0.0.1:0") : "ipc://" + (ipc_dir / name).string();
    };
    for (std::size_t s = 0; s < ps; ++s) c.ps.push_back(address("ps-sock-" + std::to_string(s)));
    for (std::size_t w = 0; w < workers; ++w)
      (w == 0 ? c.chief : c.worker).push_back(address("worker-sock-" + std::to_string(w)));
    return c;
  }

  //! Number of psx workers: the chief (if any) and TensorFlow's workers.
  std::size_t num_workers() const noexcept { return chief.size() + worker.size(); }
  //! Number of psx servers: TensorFlow's ps tasks.
  std::size_t num_servers() const noexcept { return ps.size(); }

  //! The address of psx worker `w`: the chief first, then TensorFlow's
  //! workers in order. Throws `config_error` when `w` is out of range.
  const std::string& worker_address(std::size_t w) const {
    if (w < chief.size()) return chief[w];
    if (w < num_workers()) return worker[w - chief.size()];
    throw config_error("psx: worker " + std::to_string(w) + " out of range: the cluster has " +
                       std::to_string(num_workers()) + " workers (" + std::to_string(chief.size()) + " chief + " +
                       std::to_string(worker.size()) + " worker)");
  }
  //! The address of psx server `s` (TensorFlow's ps task `s`). Throws
  //! `config_error` when `s` is out of range.
  const std::string& server_address(std::size_t s) const {
    if (s < ps.size()) return ps[s];
    throw config_error("psx: server " + std::to_string(s) + " out of range: the cluster has " +
                       std::to_string(ps.size()) + " ps tasks");
  }

  friend bool operator==(const ClusterSpec&, const ClusterSpec&) = default;
  //! Prints the cluster as TensorFlow's JSON object (compact).
  friend std::ostream& operator<<(std::ostream& os, const ClusterSpec& c) {
    rapidjson::StringBuffer buffer;
    rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
    detail::write_tf_cluster(w, c.chief, c.worker, c.ps);
    return os << buffer.GetString();
  }
};

//! Which task this process is: TensorFlow's job name ("chief", "worker" or
//! "ps") and its index in that job.
struct TaskSpec {
  //! The job: "chief", "worker" or "ps".
  std::string type;
  //! The index in the job.
  std::size_t index = 0;

  friend bool operator==(const TaskSpec&, const TaskSpec&) = default;
  //! Prints the task as TensorFlow's JSON object (compact).
  friend std::ostream& operator<<(std::ostream& os, const TaskSpec& t) {
    rapidjson::StringBuffer buffer;
    rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
    detail::write_tf_task(w, t.type, t.index);
    return os << buffer.GetString();
  }
};

//! TF_CONFIG: the cluster and this process's task.
struct TfConfig {
  //! Every task of the cluster.
  ClusterSpec cluster;
  //! This process's task.
  TaskSpec task;

  //! Parses `json` in TensorFlow's layout and checks it; `where` names the
  //! source in messages ("TF_CONFIG", a file path). Keys other than
  //! "cluster" and "task" (TensorFlow's "environment", "rpc_layer") are
  //! ignored; a missing "task.index" is 0, as in TensorFlow. Throws
  //! `config_error` naming the source and the JSON path of what is wrong.
  static TfConfig parse(std::string_view json, std::string_view where = "TF_CONFIG") {
    const std::string src(where);
    const auto fail = [&src](const std::string& path, const std::string& what) -> config_error {
      return config_error("psx: " + src + ": " + (path.empty() ? std::string() : path + ": ") + what);
    };

    rapidjson::Document doc;
    doc.Parse<rapidjson::kParseIterativeFlag>(json.data(), json.size());  // no recursion: any nesting depth
    if (doc.HasParseError())
      throw fail("", "invalid JSON at offset " + std::to_string(doc.GetErrorOffset()) + ": " +
                         rapidjson::GetParseError_En(doc.GetParseError()));
    if (!doc.IsObject())
      throw fail("", std::string("expected a JSON object {\"cluster\": {...}, \"task\": {...}}, got ") +
                         detail::tf_json_kind(doc));

    TfConfig out;

    // --- cluster ---
    const rapidjson::Value* cluster = detail::tf_member_once(doc, "cluster", src, "cluster");
    if (!cluster)
      throw fail("cluster", "missing; expected {\"cluster\": {\"chief\": [...], \"worker\": [...], \"ps\": [...]}}");
    if (!cluster->IsObject())
      throw fail("cluster",
                 std::string("expected an object of job name to addresses, got ") + detail::tf_json_kind(*cluster));
    std::vector<std::pair<std::string, std::string>> seen;  // endpoint key, JSON path
    bool has_chief = false, has_worker = false, has_ps = false;
    for (auto m = cluster->MemberBegin(); m != cluster->MemberEnd(); ++m) {
      const std::string job = detail::tf_json_string(m->name);
      const std::string path = "cluster." + job;
      std::vector<std::string>* target = nullptr;
      bool* has = nullptr;
      if (job == "chief") {
        target = &out.cluster.chief;
        has = &has_chief;
      } else if (job == "worker") {
        target = &out.cluster.worker;
        has = &has_worker;
      } else if (job == "ps") {
        target = &out.cluster.ps;
        has = &has_ps;
      } else if (job == "evaluator") {
        throw fail(path,
                   "psx has no evaluator role; run TensorFlow's evaluator outside the psx cluster and "
                   "leave it out of this cluster");
      } else {
        throw fail(path, "unknown job \"" + job + "\"; psx knows the jobs \"chief\", \"worker\" and \"ps\"");
      }
      if (*has) throw fail(path, "given twice; write each job once");
      *has = true;
      if (!m->value.IsArray())
        throw fail(path,
                   std::string("expected an array of \"host:port\" strings, got ") + detail::tf_json_kind(m->value));
      for (rapidjson::SizeType i = 0; i < m->value.Size(); ++i) {
        const rapidjson::Value& a = m->value[i];
        const std::string apath = path + "[" + std::to_string(i) + "]";
        if (!a.IsString())
          throw fail(apath, std::string("expected a \"host:port\" string, got ") + detail::tf_json_kind(a));
        std::string address = detail::tf_json_string(a);
        const auto parsed = detail::parse_tf_address(address);
        if (!parsed.problem.empty())
          throw fail(apath, "bad address \"" + detail::shown_address(address) + "\": " + parsed.problem +
                                "; expected \"host:port\", \"tcp://host:port\" or \"ipc://path\"");
        // Port 0 is ephemeral: each server binds its own free port, so
        // "127.0.0.1:0" may stand for many tasks.
        if (parsed.ipc || parsed.port != 0) {
          const std::string key = parsed.ipc ? "ipc://" + std::string(parsed.host)
                                             : "tcp://" + std::string(parsed.host) + ":" + std::to_string(parsed.port);
          for (const auto& [other_key, other_path] : seen)
            if (other_key == key)
              throw fail(apath, "address \"" + address + "\" is also " + other_path +
                                    "'s; every task needs its own (only port 0, ephemeral, may repeat)");
          seen.emplace_back(key, apath);
        }
        target->push_back(std::move(address));
      }
    }
    if (!has_ps) throw fail("cluster.ps", "missing; psx needs at least one parameter server (\"ps\" task)");
    if (out.cluster.ps.empty()) throw fail("cluster.ps", "empty; psx needs at least one parameter server");
    if (out.cluster.num_workers() == 0)
      throw fail("cluster", "no \"chief\" and no \"worker\" address; psx needs at least one worker");
    if (out.cluster.chief.size() > 1)
      throw fail("cluster.chief",
                 std::to_string(out.cluster.chief.size()) + " addresses; TensorFlow's chief job has at most one task");

    // --- task ---
    const rapidjson::Value* task = detail::tf_member_once(doc, "task", src, "task");
    if (!task) throw fail("task", "missing; expected {\"task\": {\"type\": \"worker\", \"index\": 0}}");
    if (!task->IsObject())
      throw fail("task",
                 std::string("expected an object {\"type\": ..., \"index\": ...}, got ") + detail::tf_json_kind(*task));
    const rapidjson::Value* type = detail::tf_member_once(*task, "type", src, "task.type");
    if (!type) throw fail("task.type", "missing; expected \"chief\", \"worker\" or \"ps\"");
    if (!type->IsString())
      throw fail("task.type", std::string("expected a string, got ") + detail::tf_json_kind(*type));
    out.task.type = detail::tf_json_string(*type);
    const std::vector<std::string>* job = nullptr;
    if (out.task.type == "chief") {
      job = &out.cluster.chief;
    } else if (out.task.type == "worker") {
      job = &out.cluster.worker;
    } else if (out.task.type == "ps") {
      job = &out.cluster.ps;
    } else if (out.task.type == "evaluator") {
      throw fail("task.type", "psx has no evaluator role; run TensorFlow's evaluator outside the psx cluster");
    } else {
      throw fail("task.type", "\"" + out.task.type + "\" is not a psx role; expected \"chief\", \"worker\" or \"ps\"");
    }
    if (const rapidjson::Value* index = detail::tf_member_once(*task, "index", src, "task.index")) {
      if (index->IsUint64()) {
        out.task.index = static_cast<std::size_t>(index->GetUint64());
      } else if (index->IsInt64()) {
        throw fail("task.index", std::to_string(index->GetInt64()) + " is negative");
      } else if (index->IsNumber()) {
        const double d = index->GetDouble();
        throw fail("task.index", std::string("expected a non-negative integer, got ") +
                                     (std::fabs(d) >= 0x1p64     ? "a number beyond 64 bits"
                                      : d == std::floor(d) ? "an integer in floating-point form (write it as one)"
                                                           : "a non-integer number"));
      } else {
        throw fail("task.index", std::string("expected a non-negative integer, got ") + detail::tf_json_kind(*index));
      }
    }
    if (out.task.type == "chief" && out.task.index != 0)
      throw fail("task.index", std::to_string(out.task.index) + " for the chief; the chief's index is 0");
    if (out.task.index >= job->size())
      throw fail("task.index", std::to_string(out.task.index) + " is out of range: cluster." + out.task.type + " has " +
                                   std::to_string(job->size()) + " addresses");
    return out;
  }

  //! Reads and parses the environment variable `name`. Throws `config_error`
  //! naming it when it is unset or empty, or as `parse` does.
  static TfConfig from_env(const char* name = "TF_CONFIG") {
    const char* value = std::getenv(name);
    if (!value || !*value)
      throw config_error("psx: environment variable " + std::string(name) + " is " + (value ? "empty" : "not set") +
                         "; set it to TensorFlow's cluster JSON, as in {\"cluster\": {\"chief\": [\"host:port\"], "
                         "\"ps\": [\"host:port\"]}, \"task\": {\"type\": \"chief\", \"index\": 0}}");
    return parse(value, name);
  }

  //! Reads and parses the JSON file `path`. Throws `config_error` naming the
  //! path when it cannot be read, or as `parse` does (with the path as source).
  static TfConfig from_file(const std::filesystem::path& path) {
    const auto cannot = [&path](int err) -> config_error {
      return config_error("psx: cannot read cluster file \"" + path.string() +
                          "\": " + std::generic_category().message(err));
    };
    const std::string name = path.string();
    errno = 0;
    std::FILE* f = std::fopen(name.c_str(), "rb");
    if (!f) throw cannot(errno ? errno : ENOENT);
    std::string text;
    char buffer[4096];
    std::size_t n;
    while ((n = std::fread(buffer, 1, sizeof buffer, f)) > 0) text.append(buffer, n);
    const bool failed = std::ferror(f) != 0;
    const int err = errno;
    std::fclose(f);
    if (failed) throw cannot(err ? err : EIO);
    return parse(text, name);
  }

  //! JSON text in TensorFlow's layout (compact) that `parse` reads back equal.
  std::string to_json() const {
    rapidjson::StringBuffer buffer;
    rapidjson::Writer<rapidjson::StringBuffer> w(buffer);
    w.StartObject();
    w.Key("cluster");
    detail::write_tf_cluster(w, cluster.chief, cluster.worker, cluster.ps);
    w.Key("task");
    detail::write_tf_task(w, task.type, task.index);
    w.EndObject();
    return std::string(buffer.GetString(), buffer.GetSize());
  }

  //! Whether this process is a parameter server (a "ps" task).
  bool is_server() const noexcept { return task.type == "ps"; }

  //! This process's psx worker index: 0 for the chief, TensorFlow's worker
  //! index plus one when there is a chief, else the worker index. Throws
  //! `config_error` for a ps task.
  std::size_t worker_index() const {
    if (task.type == "chief") return 0;
    if (task.type == "worker") return cluster.chief.size() + task.index;
    throw config_error("psx: task " + detail::tf_task_name(task.type, task.index) +
                       " is not a worker (its type is not \"chief\" or \"worker\")");
  }

  //! This process's psx server index (TensorFlow's ps index). Throws
  //! `config_error` for a chief or worker task.
  std::size_t server_index() const {
    if (task.type == "ps") return task.index;
    throw config_error("psx: task " + detail::tf_task_name(task.type, task.index) +
                       " is not a server (its type is not \"ps\")");
  }

  friend bool operator==(const TfConfig&, const TfConfig&) = default;
  //! Prints `to_json()`.
  friend std::ostream& operator<<(std::ostream& os, const TfConfig& c) { return os << c.to_json(); }
};

}  // namespace transport
}  // namespace v0
}  // namespace psx
