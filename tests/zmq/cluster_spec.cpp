// Tests of psx/transport/cluster_spec.hpp: TF_CONFIG parsing, the psx worker
// numbering, endpoints, and every message of a refused configuration.
#include <psx/transport/cluster_spec.hpp>

#include <doctest/doctest.h>

#include "../support.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

namespace {

using psx::config_error;
using psx::transport::ClusterSpec;
using psx::transport::TaskSpec;
using psx::transport::TfConfig;

constexpr const char* full_config = R"({
  "cluster": {
    "chief": ["host0:2222"],
    "worker": ["host1:2222", "host2:2222"],
    "ps": ["host3:2222", "host4:2222"]
  },
  "environment": "cloud",
  "task": {"type": "worker", "index": 1}
})";

// The message of the config_error that parsing `json` throws.
std::string error_of(const std::string& json, std::string_view where = "TF_CONFIG") {
  return psx_test::message_of<config_error>([&] { (void)TfConfig::parse(json, where); });
}

// A TF_CONFIG with the given cluster body and task.
std::string with_cluster(const std::string& cluster, const std::string& task = R"({"type": "chief", "index": 0})") {
  return R"({"cluster": )" + cluster + R"(, "task": )" + task + "}";
}

// A TF_CONFIG with a valid cluster (one chief, two workers, two ps) and the given task.
std::string with_task(const std::string& task) {
  return with_cluster(R"({"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1", "p:2"]})", task);
}

// A file in the temporary directory, removed at the end of the scope.
struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::string& text)
      : path(std::filesystem::temp_directory_path() / ("psx-cluster-spec-" + std::to_string(::getpid()) + ".json")) {
    std::ofstream(path) << text;
  }
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

}  // namespace

TEST_CASE("cluster_spec: a full TF_CONFIG parses into its jobs and task") {
  const TfConfig c = TfConfig::parse(full_config);
  CHECK(c.cluster.chief == std::vector<std::string>{"host0:2222"});
  CHECK(c.cluster.worker == std::vector<std::string>{"host1:2222", "host2:2222"});
  CHECK(c.cluster.ps == std::vector<std::string>{"host3:2222", "host4:2222"});
  CHECK(c.task == TaskSpec{"worker", 1});
  CHECK(c.cluster.num_workers() == 3);
  CHECK(c.cluster.num_servers() == 2);
  CHECK_FALSE(c.is_server());
  CHECK(c.worker_index() == 2);
  CHECK(c.cluster.worker_address(0) == "host0:2222");
  CHECK(c.cluster.worker_address(1) == "host1:2222");
  CHECK(c.cluster.worker_address(2) == "host2:2222");
  CHECK(c.cluster.server_address(0) == "host3:2222");
  CHECK(c.cluster.server_address(1) == "host4:2222");
  CHECK_THROWS_WITH_AS((void)c.cluster.worker_address(3),
                       "psx: worker 3 out of range: the cluster has 3 workers (1 chief + 2 worker)", config_error);
  CHECK_THROWS_WITH_AS((void)c.cluster.server_address(2), "psx: server 2 out of range: the cluster has 2 ps tasks",
                       config_error);
  CHECK_THROWS_WITH_AS((void)c.server_index(), "psx: task \"worker\" 1 is not a server (its type is not \"ps\")",
                       config_error);
}

TEST_CASE("cluster_spec: to_json is TensorFlow's layout and parses back equal") {
  const TfConfig c = TfConfig::parse(full_config);
  CHECK(c.to_json() == R"({"cluster":{"chief":["host0:2222"],"worker":["host1:2222","host2:2222"],)"
                       R"("ps":["host3:2222","host4:2222"]},"task":{"type":"worker","index":1}})");
  CHECK(TfConfig::parse(c.to_json()) == c);

  // Without a chief, with ipc addresses and characters that JSON escapes.
  TfConfig d;
  d.cluster.worker = {"ipc:///tmp/a \"b\"", "127.0.0.1:0", "127.0.0.1:0"};
  d.cluster.ps = {"tcp://[::1]:5555", "127.0.0.1:0"};
  d.task = {"ps", 1};
  CHECK(TfConfig::parse(d.to_json()) == d);
  CHECK(d != c);

  std::ostringstream os;
  os << c.cluster << " " << c.task << " " << c;
  CHECK(os.str() == R"({"chief":["host0:2222"],"worker":["host1:2222","host2:2222"],"ps":["host3:2222","host4:2222"]})"
                    R"( {"type":"worker","index":1} )" +
                        c.to_json());
}

TEST_CASE("cluster_spec: local clusters over tcp port 0 or ipc sockets in a directory") {
  const ClusterSpec tcp = ClusterSpec::local(2, 3);
  CHECK(tcp.ps == std::vector<std::string>{"127.0.0.1:0", "127.0.0.1:0"});
  CHECK(tcp.chief == std::vector<std::string>{"127.0.0.1:0"});
  CHECK(tcp.worker.size() == 2);
  CHECK(tcp.num_workers() == 3);
  const ClusterSpec ipc = ClusterSpec::local(1, 2, "/run/x");
  CHECK(ipc.ps == std::vector<std::string>{"ipc:///run/x/ps-sock-0"});
  CHECK(ipc.chief == std::vector<std::string>{"ipc:///run/x/worker-sock-0"});
  CHECK(ipc.worker == std::vector<std::string>{"ipc:///run/x/worker-sock-1"});
  CHECK(ClusterSpec::local(1, 0).num_workers() == 0);
}

TEST_CASE("cluster_spec: psx worker indices: the chief is 0, then TensorFlow's workers") {
  CHECK(TfConfig::parse(with_task(R"({"type": "chief", "index": 0})")).worker_index() == 0);
  CHECK(TfConfig::parse(with_task(R"({"type": "worker", "index": 0})")).worker_index() == 1);
  CHECK(TfConfig::parse(with_task(R"({"type": "worker", "index": 1})")).worker_index() == 2);
  const TfConfig ps = TfConfig::parse(with_task(R"({"type": "ps", "index": 1})"));
  CHECK(ps.is_server());
  CHECK(ps.server_index() == 1);
  CHECK_THROWS_WITH_AS((void)ps.worker_index(),
                       "psx: task \"ps\" 1 is not a worker (its type is not \"chief\" or \"worker\")", config_error);

  // Without a chief, TensorFlow's worker i is psx worker i.
  const std::string no_chief = R"({"worker": ["w:1", "w:2"], "ps": ["p:1"]})";
  const TfConfig w1 = TfConfig::parse(with_cluster(no_chief, R"({"type": "worker", "index": 1})"));
  CHECK(w1.worker_index() == 1);
  CHECK(w1.cluster.num_workers() == 2);
  CHECK(w1.cluster.worker_address(0) == "w:1");
  CHECK(w1.cluster.worker_address(1) == "w:2");
  CHECK(TfConfig::parse(with_cluster(no_chief, R"({"type": "worker", "index": 0})")).worker_index() == 0);

  // A chief alone, and TensorFlow's default index 0.
  const TfConfig chief = TfConfig::parse(with_cluster(R"({"chief": ["c:1"], "ps": ["p:1"]})", R"({"type": "chief"})"));
  CHECK(chief.task == TaskSpec{"chief", 0});
  CHECK(chief.worker_index() == 0);
  CHECK(chief.cluster.num_workers() == 1);
}

TEST_CASE("cluster_spec: zmq_endpoint and tcp_port") {
  using psx::transport::tcp_port;
  using psx::transport::zmq_endpoint;
  CHECK(zmq_endpoint("localhost:5555") == "tcp://localhost:5555");
  CHECK(zmq_endpoint("127.0.0.1:0") == "tcp://127.0.0.1:0");
  CHECK(zmq_endpoint("[::1]:7") == "tcp://[::1]:7");
  CHECK(zmq_endpoint("tcp://10.0.0.1:80") == "tcp://10.0.0.1:80");
  CHECK(zmq_endpoint("ipc:///tmp/psx/ps-0") == "ipc:///tmp/psx/ps-0");
  CHECK(tcp_port("localhost:5555") == 5555);
  CHECK(tcp_port("tcp://10.0.0.1:65535") == 65535);
  CHECK(tcp_port("127.0.0.1:0") == 0);
  CHECK(tcp_port("ipc:///tmp/psx/ps-0") == std::nullopt);
  CHECK_THROWS_WITH_AS((void)zmq_endpoint("localhost"),
                       "psx: address \"localhost\": no \":port\"; expected \"host:port\", \"tcp://host:port\" or "
                       "\"ipc://path\"",
                       config_error);
  CHECK_THROWS_WITH_AS((void)tcp_port("h:65536"),
                       "psx: address \"h:65536\": the port \"65536\" is not a decimal number in [0, 65535]; "
                       "expected \"host:port\", \"tcp://host:port\" or \"ipc://path\"",
                       config_error);
  CHECK_THROWS_AS((void)zmq_endpoint("udp://h:1"), config_error);
  CHECK_THROWS_AS((void)tcp_port("ipc://"), config_error);
}

TEST_CASE("cluster_spec: from_env reads the variable and names it when unset or empty") {
  ::setenv("PSX_TEST_TF_CONFIG", full_config, 1);
  CHECK(TfConfig::from_env("PSX_TEST_TF_CONFIG") == TfConfig::parse(full_config));
  ::setenv("PSX_TEST_TF_CONFIG", R"({"cluster": {"ps": ["p:1"]}})", 1);
  CHECK(psx_test::message_of<config_error>([] { (void)TfConfig::from_env("PSX_TEST_TF_CONFIG"); }) ==
        "psx: PSX_TEST_TF_CONFIG: cluster: no \"chief\" and no \"worker\" address; psx needs at least one worker");
  ::setenv("PSX_TEST_TF_CONFIG", "", 1);
  CHECK(psx_test::message_of<config_error>([] {
          (void)TfConfig::from_env("PSX_TEST_TF_CONFIG");
        }).starts_with("psx: environment variable PSX_TEST_TF_CONFIG is empty; set it to TensorFlow's cluster JSON"));
  ::unsetenv("PSX_TEST_TF_CONFIG");
  CHECK(psx_test::message_of<config_error>([] {
          (void)TfConfig::from_env("PSX_TEST_TF_CONFIG");
        }).starts_with("psx: environment variable PSX_TEST_TF_CONFIG is not set;"));

  // The default name.
  const char* saved = std::getenv("TF_CONFIG");
  const std::string old = saved ? saved : "";
  ::setenv("TF_CONFIG", full_config, 1);
  CHECK(TfConfig::from_env().task == TaskSpec{"worker", 1});
  if (saved) {
    ::setenv("TF_CONFIG", old.c_str(), 1);
  } else {
    ::unsetenv("TF_CONFIG");
  }
}

TEST_CASE("cluster_spec: from_file reads a file and names it in every message") {
  {
    const TempFile file(full_config);
    CHECK(TfConfig::from_file(file.path) == TfConfig::parse(full_config));
  }
  {
    const TempFile file(R"({"cluster": {"chief": ["c:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 1}})");
    CHECK(psx_test::message_of<config_error>([&] { (void)TfConfig::from_file(file.path); }) ==
          "psx: " + file.path.string() + ": task.index: 1 is out of range: cluster.ps has 1 addresses");
  }
  const std::filesystem::path missing = std::filesystem::temp_directory_path() / "psx-no-such-dir" / "tf.json";
  CHECK_THROWS_WITH_AS(
      (void)TfConfig::from_file(missing),
      ("psx: cannot read cluster file \"" + missing.string() + "\": No such file or directory").c_str(), config_error);
  // A directory opens but does not read.
  CHECK_THROWS_WITH_AS((void)TfConfig::from_file(std::filesystem::temp_directory_path()),
                       doctest::Contains("psx: cannot read cluster file \""), config_error);
}

TEST_CASE("cluster_spec: malformed JSON and a root that is not an object") {
  CHECK(error_of(R"({"cluster": {"ps": ["p:1"]} "task": {}})") ==
        "psx: TF_CONFIG: invalid JSON at offset 28: Missing a comma or '}' after an object member.");
  CHECK(error_of("") == "psx: TF_CONFIG: invalid JSON at offset 0: The document is empty.");
  CHECK(error_of(std::string(full_config) + " x", "tf.json") ==
        "psx: tf.json: invalid JSON at offset " + std::to_string(std::string(full_config).size() + 1) +
            ": The document root must not be followed by other values.");
  CHECK(error_of(R"(["c:1"])") ==
        "psx: TF_CONFIG: expected a JSON object {\"cluster\": {...}, \"task\": {...}}, got an array");
  CHECK(error_of("42") == "psx: TF_CONFIG: expected a JSON object {\"cluster\": {...}, \"task\": {...}}, got a number");
  // Nesting of any depth is parsed without recursion (a million '[' once
  // overflowed the stack), then refused like any other root.
  const std::size_t depth = 1'000'000;
  CHECK(error_of(std::string(depth, '[') + std::string(depth, ']')) ==
        "psx: TF_CONFIG: expected a JSON object {\"cluster\": {...}, \"task\": {...}}, got an array");
  CHECK(error_of(std::string(depth, '[')) ==
        "psx: TF_CONFIG: invalid JSON at offset " + std::to_string(depth) + ": Invalid value.");
}

TEST_CASE("cluster_spec: the cluster object and its jobs") {
  CHECK(
      error_of(R"({"task": {"type": "chief", "index": 0}})") ==
      "psx: TF_CONFIG: cluster: missing; expected {\"cluster\": {\"chief\": [...], \"worker\": [...], \"ps\": [...]}}");
  CHECK(error_of(with_cluster(R"(["c:1"])")) ==
        "psx: TF_CONFIG: cluster: expected an object of job name to addresses, got an array");
  CHECK(error_of(R"({"cluster": {"chief": ["c:1"], "ps": ["p:1"]}, "cluster": {}, "task": {"type": "chief"}})") ==
        "psx: TF_CONFIG: cluster: given twice; write each key once");
  CHECK(error_of(with_cluster(R"({"chief": ["c:1"]})")) ==
        "psx: TF_CONFIG: cluster.ps: missing; psx needs at least one parameter server (\"ps\" task)");
  CHECK(error_of(with_cluster(R"({"chief": ["c:1"], "ps": []})")) ==
        "psx: TF_CONFIG: cluster.ps: empty; psx needs at least one parameter server");
  CHECK(error_of(with_cluster(R"({"ps": ["p:1"]})", R"({"type": "ps", "index": 0})")) ==
        "psx: TF_CONFIG: cluster: no \"chief\" and no \"worker\" address; psx needs at least one worker");
  CHECK(error_of(with_cluster(R"({"chief": [], "worker": [], "ps": ["p:1"]})", R"({"type": "ps"})")) ==
        "psx: TF_CONFIG: cluster: no \"chief\" and no \"worker\" address; psx needs at least one worker");
  CHECK(error_of(with_cluster(R"({"chief": ["c:1", "c:2"], "ps": ["p:1"]})")) ==
        "psx: TF_CONFIG: cluster.chief: 2 addresses; TensorFlow's chief job has at most one task");
  CHECK(error_of(with_cluster(R"({"chief": ["c:1"], "ps": ["p:1"], "evaluator": ["e:1"]})")) ==
        "psx: TF_CONFIG: cluster.evaluator: psx has no evaluator role; run TensorFlow's evaluator outside the psx "
        "cluster and leave it out of this cluster");
  CHECK(error_of(with_cluster(R"({"chief": ["c:1"], "ps": ["p:1"], "master": ["m:1"]})")) ==
        "psx: TF_CONFIG: cluster.master: unknown job \"master\"; psx knows the jobs \"chief\", \"worker\" and \"ps\"");
  CHECK(error_of(with_cluster(R"({"chief": ["c:1"], "ps": ["p:1"], "ps": ["p:2"]})")) ==
        "psx: TF_CONFIG: cluster.ps: given twice; write each job once");
  // TensorFlow's sparse form {"worker": {"1": "host:port"}} is not for psx.
  CHECK(error_of(with_cluster(R"({"chief": ["c:1"], "ps": {"0": "p:1"}})")) ==
        "psx: TF_CONFIG: cluster.ps: expected an array of \"host:port\" strings, got an object");
}

TEST_CASE("cluster_spec: addresses") {
  const auto ps = [](const std::string& addresses) {
    return error_of(with_cluster(R"({"chief": ["c:1"], "ps": [)" + addresses + "]}"));
  };
  const std::string expected = "; expected \"host:port\", \"tcp://host:port\" or \"ipc://path\"";
  CHECK(ps(R"("p:1", 2)") == "psx: TF_CONFIG: cluster.ps[1]: expected a \"host:port\" string, got a number");
  CHECK(ps(R"(null)") == "psx: TF_CONFIG: cluster.ps[0]: expected a \"host:port\" string, got null");
  CHECK(ps(R"(":1")") == "psx: TF_CONFIG: cluster.ps[0]: bad address \":1\": the host is empty" + expected);
  CHECK(ps(R"("p")") == "psx: TF_CONFIG: cluster.ps[0]: bad address \"p\": no \":port\"" + expected);
  CHECK(ps(R"("p:")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"p:\": the port \"\" is not a decimal number in [0, 65535]" +
            expected);
  CHECK(ps(R"("p:65536")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"p:65536\": the port \"65536\" is not a decimal number in "
        "[0, 65535]" +
            expected);
  CHECK(ps(R"("p:-1")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"p:-1\": the port \"-1\" is not a decimal number in [0, 65535]" +
            expected);
  CHECK(ps(R"("p:80x")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"p:80x\": the port \"80x\" is not a decimal number in "
        "[0, 65535]" +
            expected);
  CHECK(ps(R"("p:99999999999999999999")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"p:99999999999999999999\": the port \"99999999999999999999\" is "
        "not a decimal number in [0, 65535]" +
            expected);
  CHECK(ps(R"("p:80/x")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"p:80/x\": the port \"80/x\" is not a decimal number in "
        "[0, 65535]" +
            expected);
  CHECK(ps(R"("http://p:80")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"http://p:80\": unsupported scheme" + expected);
  CHECK(ps(R"("ipc://")") == "psx: TF_CONFIG: cluster.ps[0]: bad address \"ipc://\": the ipc path is empty" + expected);
  CHECK(ps(R"("tcp://:1")") == "psx: TF_CONFIG: cluster.ps[0]: bad address \"tcp://:1\": the host is empty" + expected);
  CHECK(ps(R"("::1:80")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"::1:80\": an IPv6 host must be in brackets, as in "
        "\"[::1]:5555\"" +
            expected);
  CHECK(ps(R"("a b:80")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"a b:80\": the host contains a space, a control character or a "
        "'/'" + expected);
  CHECK(ps(R"("b\u0000c:2")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"b\\x00c:2\": the host contains a space, a control character "
        "or a '/'" + expected);
  CHECK(ps(R"("*:2")") ==
        "psx: TF_CONFIG: cluster.ps[0]: bad address \"*:2\": the host is \"*\" (every interface): a cluster address "
        "names the interface the server binds, which its workers connect to" + expected);
  // The same, as addresses, in any spelling of the unspecified one (libzmq
  // bound "[::0]" and "[0:0::0.0.0.0]" to every interface).
  for (const char* every : {"0.0.0.0", "[::]", "[::0]", "[0::]", "[0:0::0.0.0.0]"})
    CHECK(ps("\"" + std::string(every) + ":2\"") ==
          "psx: TF_CONFIG: cluster.ps[0]: bad address \"" + std::string(every) + ":2\": the host is \"" + every +
              "\" (every interface): a cluster address names the interface the server binds, which its workers "
              "connect to" +
              expected);
  for (const char* bracketed : {"[]:5", "[abc:5", "abc]:5", "[a b]:5", "[1.2.3.4]:5"})
    CHECK(ps("\"" + std::string(bracketed) + "\"") ==
          "psx: TF_CONFIG: cluster.ps[0]: bad address \"" + std::string(bracketed) + "\": " +
              (std::string_view(bracketed) == "[a b]:5"
                   ? "the host contains a space, a control character or a '/'"
                   : "the host \"" + std::string(bracketed).substr(0, std::string(bracketed).rfind(':')) +
                         "\" is not a bracketed IPv6 address such as \"[::1]\"") +
              expected);

  // Valid forms.
  const TfConfig ok =
      TfConfig::parse(with_cluster(R"({"chief": ["c:1"], "ps": ["tcp://p:2", "ipc:///tmp/x", "[::1]:3", "p:004",
                                   "[fe80::1%eth0]:4", "[::ffff:127.0.0.1]:5", "[fe80::1%br-lan]:6"]})"));
  CHECK(ok.cluster.ps.size() == 7);
}

TEST_CASE("cluster_spec: an address used twice is refused, except port 0") {
  CHECK(error_of(with_cluster(R"({"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3", "h:2"]})")) ==
        "psx: TF_CONFIG: cluster.ps[1]: address \"h:2\" is also cluster.worker[0]'s; every task needs its own "
        "(only port 0, ephemeral, may repeat)");
  // The same endpoint written two ways.
  CHECK(error_of(with_cluster(R"({"chief": ["tcp://h:1"], "ps": ["h:01"]})")) ==
        "psx: TF_CONFIG: cluster.ps[0]: address \"h:01\" is also cluster.chief[0]'s; every task needs its own "
        "(only port 0, ephemeral, may repeat)");
  CHECK(error_of(with_cluster(R"({"chief": ["ipc:///tmp/a"], "ps": ["ipc:///tmp/a"]})")) ==
        "psx: TF_CONFIG: cluster.ps[0]: address \"ipc:///tmp/a\" is also cluster.chief[0]'s; every task needs its "
        "own (only port 0, ephemeral, may repeat)");
  const TfConfig ephemeral = TfConfig::parse(
      with_cluster(R"({"chief": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"], "ps": ["127.0.0.1:0", "127.0.0.1:0"]})",
                   R"({"type": "ps", "index": 1})"));
  CHECK(ephemeral.cluster.num_workers() == 2);
  CHECK(ephemeral.server_index() == 1);
}

TEST_CASE("cluster_spec: the task") {
  const std::string cluster = R"({"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1", "p:2"]})";
  CHECK(error_of(R"({"cluster": )" + cluster + "}") ==
        "psx: TF_CONFIG: task: missing; expected {\"task\": {\"type\": \"worker\", \"index\": 0}}");
  CHECK(error_of(with_task(R"("worker")")) ==
        "psx: TF_CONFIG: task: expected an object {\"type\": ..., \"index\": ...}, got a string");
  CHECK(error_of(with_task(R"({"index": 0})")) ==
        "psx: TF_CONFIG: task.type: missing; expected \"chief\", \"worker\" or \"ps\"");
  CHECK(error_of(with_task(R"({"type": 1, "index": 0})")) ==
        "psx: TF_CONFIG: task.type: expected a string, got a number");
  CHECK(error_of(with_task(R"({"type": "master", "index": 0})")) ==
        "psx: TF_CONFIG: task.type: \"master\" is not a psx role; expected \"chief\", \"worker\" or \"ps\"");
  CHECK(error_of(with_task(R"({"type": "evaluator", "index": 0})")) ==
        "psx: TF_CONFIG: task.type: psx has no evaluator role; run TensorFlow's evaluator outside the psx cluster");
  CHECK(error_of(with_task(R"({"type": "worker", "index": -1})")) == "psx: TF_CONFIG: task.index: -1 is negative");
  CHECK(error_of(with_task(R"({"type": "worker", "index": 1.5})")) ==
        "psx: TF_CONFIG: task.index: expected a non-negative integer, got a non-integer number");
  CHECK(error_of(with_task(R"({"type": "worker", "index": 1e19})")) ==
        "psx: TF_CONFIG: task.index: expected a non-negative integer, got an integer in floating-point form (write it "
        "as one)");
  for (const char* huge : {"18446744073709551616", "1e30", "-1e30"})
    CHECK(error_of(with_task(R"({"type": "worker", "index": )" + std::string(huge) + "}")) ==
          "psx: TF_CONFIG: task.index: expected a non-negative integer, got a number beyond 64 bits");
  CHECK(error_of(with_task(R"({"type": "worker", "index": "1"})")) ==
        "psx: TF_CONFIG: task.index: expected a non-negative integer, got a string");
  CHECK(error_of(with_task(R"({"type": "worker", "index": 2})")) ==
        "psx: TF_CONFIG: task.index: 2 is out of range: cluster.worker has 2 addresses");
  CHECK(error_of(with_task(R"({"type": "ps", "index": 18446744073709551615})")) ==
        "psx: TF_CONFIG: task.index: 18446744073709551615 is out of range: cluster.ps has 2 addresses");
  CHECK(error_of(with_task(R"({"type": "chief", "index": 1})")) ==
        "psx: TF_CONFIG: task.index: 1 for the chief; the chief's index is 0");
  CHECK(error_of(with_cluster(R"({"worker": ["w:1"], "ps": ["p:1"]})", R"({"type": "chief", "index": 0})")) ==
        "psx: TF_CONFIG: task.index: 0 is out of range: cluster.chief has 0 addresses");
}
