// Config file parsing: the shipped file, the examples, layering, and every
// error path with its FILE:LINE:COL: key '...' message.
#include "dbuf/daemon/config.hpp"

#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/temp_dir.hpp"
#include "support/text.hpp"

namespace dbuf::daemon {
namespace {

using dbuf::testing::TempDir;

const std::string kConfigDir = DBUF_CONFIG_DIR;

using dbuf::testing::readFile;

TEST(Config, ShippedFileParsesToTheStructDefaultsButServesMetricsOnLoopback) {
  Result<Config> config = loadConfig(kConfigDir + "/dbufd.toml");
  ASSERT_TRUE(config.ok()) << config.error().message;
  // The one key apart: an installed dbufd serves metrics; one without a
  // file (tests, embedded daemons, many at once) takes no port.
  Config expected;
  expected.metrics_listen = "127.0.0.1:9478";
  EXPECT_EQ(*config, expected);
}

TEST(Config, ShippedFileSpellsOutEveryKey) {
  // "Documents every key with its default": each key is present (not only in
  // a comment), so the equality above checks the documented values.
  const toml::table root = toml::parse_file(kConfigDir + "/dbufd.toml");
  for (const char* key : {"daemon.socket", "daemon.backend", "daemon.log_level", "daemon.memory_limit",
                          "daemon.virtual_ranks", "rings.entries", "rings.busy_poll_us", "timeouts.handshake_ms",
                          "timeouts.register_ms", "timeouts.collective_ms", "persistence.grace_period_s", "cluster.address",
                          "cluster.store_hosts", "metrics.listen", "admin.uids", "admin.gids"}) {
    EXPECT_TRUE(root.at_path(key)) << key;
  }
  // Tenants are commented out (the default is none); their keys are described.
  const std::string text = readFile(kConfigDir + "/dbufd.toml");
  for (const char* key : {"[[tenant]]", "name =", "uids =", "gids =", "memory_quota =", "max_jobs ="}) {
    EXPECT_NE(text.find(key), std::string::npos) << key;
  }
}

TEST(Config, ExamplesParse) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kConfigDir + "/examples")) {
    if (entry.path().extension() != ".toml") continue;
    ++count;
    Result<Config> config = loadConfig(entry.path().string());
    EXPECT_TRUE(config.ok()) << (config.ok() ? "" : config.error().message);
  }
  EXPECT_GE(count, 3);
}

TEST(Config, EmptyTextGivesDefaults) {
  Result<Config> config = parseConfig("", "empty.toml");
  ASSERT_TRUE(config.ok()) << config.error().message;
  EXPECT_EQ(*config, Config{});
}

TEST(Config, EveryKeyIsRead) {
  const std::string text = R"(
[daemon]
socket = "/tmp/d.sock"
backend = "auto"
log_level = "debug"
memory_limit = 4096
virtual_ranks = 8

[rings]
entries = 16
busy_poll_us = 0

[timeouts]
handshake_ms = 1
register_ms = 3600000
collective_ms = 7

[persistence]
grace_period_s = 0

[cluster]
address = "10.0.0.11"
store_hosts = ["10.0.0.1:6379", "redis.example:7000"]

[admin]
uids = [501]
gids = [4242, 0]

[[tenant]]
name = "a"
uids = [1000, 1001]
memory_quota = "1MiB"
max_jobs = 3

[[tenant]]
name = "b.c-d_e"
gids = [0]
)";
  Result<Config> config = parseConfig(text, "all.toml");
  ASSERT_TRUE(config.ok()) << config.error().message;
  Config expected;
  expected.socket_path = "/tmp/d.sock";
  expected.backend = Backend::kAuto;
  expected.log_level = LogLevel::kDebug;
  expected.memory_limit_bytes = 4096;
  expected.virtual_ranks = 8;
  expected.ring_entries = 16;
  expected.busy_poll = std::chrono::microseconds{0};
  expected.handshake_timeout = std::chrono::milliseconds{1};
  expected.register_timeout = std::chrono::milliseconds{3600000};
  expected.collective_timeout = std::chrono::milliseconds{7};
  expected.persistence_grace = std::chrono::seconds{0};
  expected.cluster_address = "10.0.0.11";
  expected.cluster_store_hosts = {"10.0.0.1:6379", "redis.example:7000"};
  expected.admin_uids = {501};
  expected.admin_gids = {4242, 0};
  expected.tenants = {Tenant{"a", {1000, 1001}, {}, 1 << 20, 3},
                      Tenant{"b.c-d_e", {}, {0}, Tenant{}.memory_quota_bytes, 16}};
  EXPECT_EQ(*config, expected);
}

TEST(Config, DottedKeysAndInlineTablesAreTheSameKeys) {
  Result<Config> config = parseConfig(
      "daemon.socket = \"/tmp/x.sock\"\nrings = { entries = 64 }\ntenant = [{ name = \"t\", uids = [5] }]\n",
      "dotted.toml");
  ASSERT_TRUE(config.ok()) << config.error().message;
  EXPECT_EQ(config->socket_path, "/tmp/x.sock");
  EXPECT_EQ(config->ring_entries, 64U);
  ASSERT_EQ(config->tenants.size(), 1U);
  EXPECT_EQ(config->tenants[0].uids, std::vector<std::uint32_t>{5});
}

struct BadFile {
  const char* name;
  const char* text;
  int line;
  const char* key;       // nullptr: a TOML syntax error, which names no key
  const char* fragment;  // part of the explanation
};

std::ostream& operator<<(std::ostream& out, const BadFile& bad) {
  return out << bad.name;
}

class ConfigErrors : public ::testing::TestWithParam<BadFile> {};

TEST_P(ConfigErrors, NameFileLineAndKey) {
  const BadFile& bad = GetParam();
  const TempDir dir;
  const std::string path = dir.write(std::string(bad.name) + ".toml", bad.text);
  Result<Config> config = Config{};
  ASSERT_NO_THROW(config = loadConfig(path));
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.error().code, ErrorCode::kInvalidArgument);
  const std::string& message = config.error().message;
  const std::string first_line = message.substr(0, message.find('\n'));
  const std::string where = path + ":" + std::to_string(bad.line) + ":";
  EXPECT_EQ(first_line.rfind(where, 0), 0U) << "expected it to start with " << where << "\n got: " << message;
  if (bad.key != nullptr) {
    const std::string key = std::string(": key '") + bad.key + "': ";
    EXPECT_NE(first_line.find(key), std::string::npos) << "expected " << key << "\n got: " << message;
  }
  EXPECT_NE(message.find(bad.fragment), std::string::npos) << "expected '" << bad.fragment << "'\n got: " << message;
}

// clang-format off
const BadFile kBadFiles[] = {
  {"unknown_table", "[daemon]\nsocket = \"/tmp/s\"\n[deamon]\n", 3, "deamon", "did you mean 'daemon'"},
  {"unknown_table_far", "[monitoring]\nport = 9000\n", 1, "monitoring", "unknown table (expected daemon, rings, timeouts, persistence, cluster, metrics, admin or tenant"},
  {"unknown_key", "[daemon]\nsockett = \"/tmp/s\"\n", 2, "daemon.sockett", "did you mean 'socket'"},
  {"unknown_root_key", "socket = \"/tmp/s\"\n", 1, "socket", "unknown key (expected daemon"},
  {"key_missing_unit_suffix", "[timeouts]\nhandshake = 5\n", 2, "timeouts.handshake", "did you mean 'handshake_ms'"},
  {"unknown_key_far", "[rings]\nentries = 16\nsize = 3\n", 3, "rings.size", "unknown key"},
  {"string_for_int", "[timeouts]\nhandshake_ms = \"2000\"\n", 2, "timeouts.handshake_ms", "expected an integer, got a string"},
  {"float_for_int", "[timeouts]\nregister_ms = 2.5\n", 2, "timeouts.register_ms", "got a floating-point number"},
  {"timeout_zero", "[timeouts]\n\nhandshake_ms = 0\n", 3, "timeouts.handshake_ms", "out of range (1..3600000 ms)"},
  {"timeout_too_long", "[timeouts]\ncollective_ms = 3600001\n", 2, "timeouts.collective_ms", "out of range"},
  {"ring_not_power_of_two", "[rings]\nentries = 1000\n", 2, "rings.entries", "not a power of two"},
  {"ring_too_small", "[rings]\nentries = 8\n", 2, "rings.entries", "out of range (16..65536)"},
  {"ring_too_big", "[rings]\nentries = 131072\n", 2, "rings.entries", "out of range"},
  {"busy_poll_negative", "[rings]\nbusy_poll_us = -1\n", 2, "rings.busy_poll_us", "out of range (0..100000 us)"},
  {"grace_too_long", "[persistence]\ngrace_period_s = 86401\n", 2, "persistence.grace_period_s", "out of range"},
  {"bad_backend", "[daemon]\nbackend = \"gpu\"\n", 2, "daemon.backend", "unknown backend \"gpu\""},
  {"bad_log_level", "[daemon]\nlog_level = \"verbose\"\n", 2, "daemon.log_level", "unknown log level"},
  {"log_level_int", "[daemon]\nlog_level = 3\n", 2, "daemon.log_level", "expected a string, got an integer"},
  {"bad_size_unit", "[daemon]\nmemory_limit = \"64GB2\"\n", 2, "daemon.memory_limit", "unknown unit"},
  {"negative_size", "[daemon]\nmemory_limit = -1\n", 2, "daemon.memory_limit", "negative size"},
  {"zero_size", "[daemon]\nmemory_limit = 0\n", 2, "daemon.memory_limit", "greater than zero"},
  {"too_many_virtual_ranks", "[daemon]\nvirtual_ranks = 1025\n", 2, "daemon.virtual_ranks", "1024"},
  {"float_size", "[daemon]\nmemory_limit = 1.5\n", 2, "daemon.memory_limit", "expected a size"},
  {"size_overflow", "[daemon]\nmemory_limit = \"20000000TiB\"\n", 2, "daemon.memory_limit", "does not fit in 64 bits"},
  {"empty_socket", "[daemon]\nsocket = \"\"\n", 2, "daemon.socket", "socket path is empty"},
  {"long_socket", "[daemon]\nsocket = \"/run/xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx.sock\"\n",
   2, "daemon.socket", "at most 107"},
  {"table_is_int", "daemon = 5\n", 1, "daemon", "expected a table, got an integer"},
  {"tenant_is_table", "[tenant]\nname = \"a\"\nuids = [1]\n", 1, "tenant", "[[tenant]]"},
  {"tenant_no_members", "[[tenant]]\nname = \"a\"\ngids = [1]\n[[tenant]]\nname = \"b\"\nuids = []\n", 4, "tenant[1]", "tenant 'b' admits nobody"},
  {"tenant_no_name", "[[tenant]]\nuids = [1]\n", 1, "tenant[0].name", "missing"},
  {"tenant_bad_name", "[[tenant]]\nname = \"a b\"\nuids = [1]\n", 2, "tenant[0].name", "only letters"},
  {"tenant_duplicate_name", "[[tenant]]\nname = \"a\"\nuids = [1]\n\n[[tenant]]\nname = \"a\"\nuids = [2]\n", 6,
   "tenant[1].name", "duplicate tenant name 'a' (first at line 2)"},
  {"uid_in_two_tenants", "[[tenant]]\nname = \"a\"\nuids = [1, 2]\n[[tenant]]\nname = \"b\"\nuids = [3,\n  2]\n", 7,
   "tenant[1].uids[1]", "uid 2 already belongs to tenant 'a' (line 3)"},
  {"gid_in_two_tenants", "[[tenant]]\nname = \"a\"\ngids = [7]\n[[tenant]]\nname = \"b\"\ngids = [7]\n", 6,
   "tenant[1].gids[0]", "gid 7 already belongs to tenant 'a'"},
  {"uid_twice_in_tenant", "[[tenant]]\nname = \"a\"\nuids = [1, 1]\n", 3, "tenant[0].uids[1]", "listed twice"},
  {"uid_negative", "[[tenant]]\nname = \"a\"\nuids = [-1]\n", 3, "tenant[0].uids[0]", "out of range (0..4294967294)"},
  {"uid_too_big", "[[tenant]]\nname = \"a\"\nuids = [4294967295]\n", 3, "tenant[0].uids[0]", "out of range"},
  {"uids_not_array", "[[tenant]]\nname = \"a\"\nuids = 1000\n", 3, "tenant[0].uids", "expected an array of integers"},
  {"max_jobs_zero", "[[tenant]]\nname = \"a\"\nuids = [1]\nmax_jobs = 0\n", 4, "tenant[0].max_jobs", "out of range (1..65536)"},
  {"quota_bad", "[[tenant]]\nname = \"a\"\nuids = [1]\nmemory_quota = \"lots\"\n", 4, "tenant[0].memory_quota", "does not start with a number"},
  {"tenant_unknown_key", "[[tenant]]\nname = \"a\"\nuids = [1]\nquota = \"1GiB\"\n", 4, "tenant[0].quota", "unknown key"},
  {"cluster_bad_address", "[cluster]\naddress = \"10.0.0.1; rm\"\n", 2, "cluster.address", "is not an IP address or host name"},
  {"cluster_hosts_not_array", "[cluster]\nstore_hosts = \"h:1\"\n", 2, "cluster.store_hosts", "expected an array"},
  {"cluster_host_without_port", "[cluster]\nstore_hosts = [\"redis\"]\n", 2, "cluster.store_hosts[0]", "is not HOST:PORT"},
  {"cluster_unknown_key", "[cluster]\ninterface = \"eth0\"\n", 2, "cluster.interface", "unknown key"},
  {"metrics_no_port", "[metrics]\nlisten = \"127.0.0.1\"\n", 2, "metrics.listen", "is not HOST:PORT or [IPV6]:PORT"},
  {"metrics_port_too_big", "[metrics]\nlisten = \"127.0.0.1:65536\"\n", 2, "metrics.listen", "a TCP port 0..65535"},
  {"metrics_bare_ipv6", "[metrics]\nlisten = \"::1:9478\"\n", 2, "metrics.listen", "[IPV6]:PORT"},
  {"metrics_bad_host", "[metrics]\nlisten = \"a b:1\"\n", 2, "metrics.listen", "is not HOST:PORT"},
  {"metrics_not_string", "[metrics]\nlisten = 9478\n", 2, "metrics.listen", "expected a string"},
  {"metrics_unknown_key", "[metrics]\nport = 9478\n", 2, "metrics.port", "unknown key"},
  {"admin_gid_twice", "[admin]\ngids = [7, 7]\n", 2, "admin.gids[1]", "gid 7 is listed twice"},
  {"admin_uid_negative", "[admin]\nuids = [-1]\n", 2, "admin.uids[0]", "out of range (0..4294967294)"},
  {"admin_unknown_key", "[admin]\ngroups = [7]\n", 2, "admin.groups", "unknown key"},
  {"syntax_error", "[daemon]\nsocket = \"/tmp/s\n", 2, nullptr, "string"},
  {"syntax_duplicate_key", "[rings]\nentries = 16\nentries = 32\n", 3, nullptr, "entries"},
  {"syntax_unclosed_table", "[daemon\n", 1, nullptr, "expected ']'"},
  {"not_utf8", "[daemon]\nsocket = \"\xff\xfe\"\n", 2, nullptr, "utf-8"},
};
// clang-format on

INSTANTIATE_TEST_SUITE_P(BadFiles, ConfigErrors, ::testing::ValuesIn(kBadFiles),
                         [](const ::testing::TestParamInfo<BadFile>& param_info) {
                           return std::string(param_info.param.name);
                         });

TEST(Config, ReportsEveryProblemInFileOrder) {
  Result<Config> config = parseConfig("[timeouts]\nhandshake_ms = 0\ncollective_ms = 0\n[rings]\nentries = 3\n", "f");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.error().message,
            "f:2:16: key 'timeouts.handshake_ms': 0 ms is out of range (1..3600000 ms)\n"
            "f:3:17: key 'timeouts.collective_ms': 0 ms is out of range (1..3600000 ms)\n"
            "f:5:11: key 'rings.entries': 3 is out of range (16..65536)");
}

TEST(Config, BadUidListDoesNotAlsoSayAdmitsNobody) {
  Result<Config> config = parseConfig("[[tenant]]\nname = \"a\"\nuids = [\"x\"]\n", "f");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.error().message.find("admits nobody"), std::string::npos) << config.error().message;
}

TEST(Config, MissingFileIsNotFound) {
  const TempDir dir;
  Result<Config> config = loadConfig(dir.path("absent.toml"));
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.error().code, ErrorCode::kNotFound);
  EXPECT_NE(config.error().message.find(dir.path("absent.toml")), std::string::npos);
}

TEST(Config, DirectoryIsAnIoError) {
  const TempDir dir;
  Result<Config> config = loadConfig(dir.path(""));
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.error().code, ErrorCode::kIo);
}

TEST(Config, FlagsOverrideTheFile) {
  Result<Config> config = parseConfig("[daemon]\nsocket = \"/tmp/file.sock\"\nlog_level = \"warn\"\n", "f");
  ASSERT_TRUE(config.ok());
  ConfigOverrides flags;
  flags.socket_path = "/tmp/flag.sock";
  flags.backend = "cuda";
  flags.virtual_ranks = "4";
  ASSERT_TRUE(applyOverrides(*config, flags).ok());
  EXPECT_EQ(config->socket_path, "/tmp/flag.sock");
  EXPECT_EQ(config->backend, Backend::kCuda);
  EXPECT_EQ(config->virtual_ranks, 4U);
  EXPECT_EQ(config->log_level, LogLevel::kWarn);  // not given on the command line: the file's value
}

TEST(Config, MetricsAddressesInEveryFormAndTheFlag) {
  for (const char* good : {"", "127.0.0.1:9478", "0.0.0.0:0", "[::1]:9478", "metrics.example:65535"}) {
    EXPECT_TRUE(validateMetricsAddress(good).ok()) << good;
    Result<Config> config = parseConfig(std::string("[metrics]\nlisten = \"") + good + "\"\n", "m");
    ASSERT_TRUE(config.ok()) << good << ": " << config.error().message;
    EXPECT_EQ(config->metrics_listen, good);
  }
  for (const char* bad : {":9478", "host:", "host:09478", "host:-1", "[::1", "[]:1", "h:1:2"}) {
    EXPECT_FALSE(validateMetricsAddress(bad).ok()) << bad;
  }
  Config config;
  ConfigOverrides flags;
  flags.metrics_listen = "127.0.0.1:0";
  ASSERT_TRUE(applyOverrides(config, flags).ok());
  EXPECT_EQ(config.metrics_listen, "127.0.0.1:0");
  flags.metrics_listen = "nowhere";
  const Result<void> applied = applyOverrides(config, flags);
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.error().message.rfind("--metrics-listen: \"nowhere\" is not HOST:PORT", 0), 0U)
      << applied.error().message;
  EXPECT_EQ(config.metrics_listen, "127.0.0.1:0");  // unchanged
}

TEST(Config, BadFlagNamesTheFlagAndChangesNothing) {
  Config config;
  ConfigOverrides flags;
  flags.socket_path = "/tmp/ok.sock";
  flags.log_level = "loud";
  Result<void> applied = applyOverrides(config, flags);
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.error().message.rfind("--log-level: unknown log level \"loud\"", 0), 0U) << applied.error().message;
  EXPECT_EQ(config, Config{});

  flags = {};
  flags.socket_path = "";
  applied = applyOverrides(config, flags);
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.error().message, "--socket: socket path is empty");

  for (const char* bad : {"", "-1", "1025", "4x", "two"}) {
    flags = {};
    flags.virtual_ranks = bad;
    applied = applyOverrides(config, flags);
    ASSERT_FALSE(applied.ok()) << bad;
    EXPECT_EQ(applied.error().message.rfind("--virtual-ranks: expected a whole number from 0 to 1024", 0), 0U)
        << applied.error().message;
    EXPECT_EQ(config, Config{});
  }
}

TEST(Config, EmptyTenantListAdmitsTheDaemonsUid) {
  const std::vector<Tenant> tenants = effectiveTenants(Config{}, 4242);
  ASSERT_EQ(tenants.size(), 1U);
  EXPECT_EQ(tenants[0].name, "default");
  EXPECT_EQ(tenants[0].uids, std::vector<std::uint32_t>{4242});
  EXPECT_TRUE(tenants[0].gids.empty());
  EXPECT_EQ(tenants[0].memory_quota_bytes, Tenant{}.memory_quota_bytes);

  Config config;
  config.tenants = {Tenant{"x", {1}, {}, 1, 1}};
  EXPECT_EQ(effectiveTenants(config, 4242), config.tenants);
}

TEST(Config, EnumSpellingsRoundTrip) {
  for (Backend b : {Backend::kHost, Backend::kCuda, Backend::kAuto}) {
    Result<Backend> parsed = parseBackend(std::string(toString(b)));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, b);
  }
  for (LogLevel l :
       {LogLevel::kTrace, LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn, LogLevel::kError, LogLevel::kOff}) {
    Result<LogLevel> parsed = parseLogLevel(std::string(toString(l)));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, l);
  }
  EXPECT_FALSE(parseBackend("HOST").ok());
  EXPECT_FALSE(parseLogLevel("").ok());
}

TEST(Config, SocketPathLimit) {
  EXPECT_TRUE(validateSocketPath(std::string(kMaxSocketPathLength, 'a')).ok());
  EXPECT_FALSE(validateSocketPath(std::string(kMaxSocketPathLength + 1, 'a')).ok());
  EXPECT_FALSE(validateSocketPath(std::string("a\0b", 3)).ok());
}

}  // namespace
}  // namespace dbuf::daemon
