// Captures what Debezium's outbox EventRouter emits, as a Kafka Connect worker would write it.
//
// Runs Debezium's embedded engine (Postgres connector, pgoutput) with the outbox EventRouter SMT
// (no overrides, or the options of an optional properties file), takes the transformed
// SourceRecords (Connect format) and converts them the
// way Kafka Connect's source worker does (WorkerSourceTask): key and value with
// org.apache.kafka.connect.storage.StringConverter, each header with the default header
// converter, org.apache.kafka.connect.storage.SimpleHeaderConverter. Writes one JSON object per
// record, in the order Debezium emitted them, to the output file.
//
// Usage: java -cp 'libs/*:.' GoldenRecords <pg port> <database> <user> <out.jsonl> <ready file> <count file> [<router.properties>]
// Creates <ready file> once the connector streams (its replication slot is active); the caller
// then inserts the rows and writes how many it inserted into <count file>. Exits after that many
// records and a quiet second (any record beyond that fails the run), or after 180 s without them.
// <router.properties> holds EventRouter options without their `transforms.outbox.` prefix
// (`table.fields.additional.placement=...`); without it the router has no options at all.
//
// When Debezium itself fails (the engine stops on an exception, as a Kafka Connect task would),
// the records it emitted before are written as usual, the cause to <out.jsonl>.stopped (its
// class and message and the first frame outside the JDK), and the exit status is 3.
//
// Output encoding (one line per record, fields in this order):
//   {"topic": "...", "key": K, "value": V, "headers": [{"name": "...", "value": H}, ...]}
// K, V and H are null (no bytes at all), a JSON string when the bytes are valid UTF-8 (the
// UTF-8 encoding of the string is exactly the bytes), or {"base64": "..."} otherwise.
// Non-ASCII characters are written as themselves; only '"', '\' and control characters
// (U+0000..U+001F, U+007F) are escaped, so the file is byte-stable across runs.

import io.debezium.embedded.Connect;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;
import java.io.OutputStreamWriter;
import java.io.Writer;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.ResultSet;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;
import org.apache.kafka.connect.storage.SimpleHeaderConverter;
import org.apache.kafka.connect.storage.StringConverter;

public class GoldenRecords {
    /** Debezium's default slot.name. */
    static final String SLOT = "debezium";

    public static void main(String[] args) throws Exception {
        if (args.length != 6 && args.length != 7) {
            System.err.println("usage: GoldenRecords <port> <database> <user> <out.jsonl> <ready file> <count file> [<router.properties>]");
            System.exit(2);
        }
        String port = args[0], db = args[1], user = args[2];
        Path out = Path.of(args[3]), ready = Path.of(args[4]), countFile = Path.of(args[5]);
        Properties router = new Properties();
        if (args.length == 7) {
            try (java.io.Reader r = Files.newBufferedReader(Path.of(args[6]), StandardCharsets.UTF_8)) {
                router.load(r);
            }
        }

        // The connector's own settings (connection, pgoutput, the table) and the EventRouter
        // with the given options only. Offsets in memory: every run starts from scratch.
        Properties p = new Properties();
        p.setProperty("name", "outboxd-golden");
        p.setProperty("connector.class", "io.debezium.connector.postgresql.PostgresConnector");
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.MemoryOffsetBackingStore");
        p.setProperty("database.hostname", "127.0.0.1");
        p.setProperty("database.port", port);
        p.setProperty("database.user", user);
        p.setProperty("database.dbname", db);
        p.setProperty("topic.prefix", "golden");
        p.setProperty("plugin.name", "pgoutput");
        p.setProperty("table.include.list", "public.outboxevent");
        p.setProperty("transforms", "outbox");
        p.setProperty("transforms.outbox.type", "io.debezium.transforms.outbox.EventRouter");
        for (String k : router.stringPropertyNames()) {
            p.setProperty("transforms.outbox." + k, router.getProperty(k));
            System.err.println("golden: transforms.outbox." + k + "=" + router.getProperty(k));
        }

        // The converters of a Kafka Connect worker configured with
        // key.converter = value.converter = StringConverter and the default header.converter.
        StringConverter keyConverter = new StringConverter();
        keyConverter.configure(Map.of(), true);
        StringConverter valueConverter = new StringConverter();
        valueConverter.configure(Map.of(), false);
        SimpleHeaderConverter headerConverter = new SimpleHeaderConverter();
        headerConverter.configure(Map.of());

        List<String> lines = new ArrayList<>();
        AtomicReference<Throwable> failure = new AtomicReference<>();
        long[] lastRecord = {0};

        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine
                .create(ChangeEventFormat.of(Connect.class))
                .using(p)
                .notifying(event -> {
                    SourceRecord r = event.record();
                    try {
                        // As WorkerSourceTask.convertTransformedRecord: headers first, then key and value.
                        StringBuilder hs = new StringBuilder("[");
                        boolean first = true;
                        org.apache.kafka.common.header.internals.RecordHeaders kafkaHeaders =
                                new org.apache.kafka.common.header.internals.RecordHeaders();
                        for (Header h : r.headers()) {
                            byte[] raw = headerConverter.fromConnectHeader(r.topic(), h.key(), h.schema(), h.value());
                            kafkaHeaders.add(h.key(), raw);
                            if (!first) hs.append(", ");
                            first = false;
                            hs.append("{\"name\": ").append(jsonString(h.key()))
                              .append(", \"value\": ").append(bytes(raw)).append('}');
                        }
                        hs.append(']');
                        byte[] key = keyConverter.fromConnectData(r.topic(), kafkaHeaders, r.keySchema(), r.key());
                        byte[] value = valueConverter.fromConnectData(r.topic(), kafkaHeaders, r.valueSchema(), r.value());
                        String line = "{\"topic\": " + jsonString(r.topic())
                                + ", \"key\": " + bytes(key)
                                + ", \"value\": " + bytes(value)
                                + ", \"headers\": " + hs + "}";
                        synchronized (lines) {
                            lines.add(line);
                            lastRecord[0] = System.nanoTime();
                        }
                    } catch (Throwable t) {
                        failure.compareAndSet(null, t);
                    }
                })
                .using((success, message, error) -> {
                    if (!success) {
                        failure.compareAndSet(null, error != null ? error : new RuntimeException(message));
                    }
                })
                .build();

        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        int status = 0;
        Throwable stopped = null;
        try {
            waitForSlot(port, db, user, failure);
            Files.writeString(ready, "streaming\n");
            System.err.println("golden: connector streaming");
            long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(180);
            while (!Files.exists(countFile)) {
                if (System.nanoTime() > deadline) throw new RuntimeException("no row count in " + countFile);
                Thread.sleep(100);
            }
            int expected = Integer.parseInt(Files.readString(countFile).trim());
            System.err.println("golden: waiting for " + expected + " records");
            while (true) {
                if (failure.get() != null) {
                    stopped = failure.get();
                    break;
                }
                int n;
                long last;
                synchronized (lines) {
                    n = lines.size();
                    last = lastRecord[0];
                }
                if (n >= expected && System.nanoTime() - last > TimeUnit.SECONDS.toNanos(1)) {
                    if (n > expected) throw new RuntimeException("Debezium emitted " + n + " records, expected " + expected);
                    break;
                }
                if (System.nanoTime() > deadline) throw new RuntimeException("timed out with " + n + " of " + expected + " records");
                Thread.sleep(100);
            }
            try (Writer w = new OutputStreamWriter(Files.newOutputStream(out), StandardCharsets.UTF_8)) {
                synchronized (lines) {
                    for (String l : lines) w.write(l + "\n");
                }
            }
            System.err.println("golden: wrote " + lines.size() + " records to " + out);
            if (stopped != null) {
                Files.writeString(Path.of(out + ".stopped"), cause(stopped), StandardCharsets.UTF_8);
                System.err.println("golden: Debezium stopped: " + cause(stopped).trim());
                status = 3;
            }
        } catch (Exception e) {
            e.printStackTrace();
            status = 1;
        } finally {
            try {
                engine.close();
            } catch (Exception e) {
                // Already stopped on its own failure.
            }
            executor.shutdown();
            executor.awaitTermination(30, TimeUnit.SECONDS);
        }
        System.exit(status);
    }

    /** Waits until the connector's replication slot is active (it streams from then on). */
    static void waitForSlot(String port, String db, String user, AtomicReference<Throwable> failure) throws Exception {
        Properties props = new Properties();
        props.setProperty("user", user);
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(120);
        try (Connection c = DriverManager.getConnection("jdbc:postgresql://127.0.0.1:" + port + "/" + db, props)) {
            while (true) {
                if (failure.get() != null) throw new RuntimeException("Debezium failed", failure.get());
                try (ResultSet rs = c.createStatement().executeQuery(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = '" + SLOT + "'")) {
                    if (rs.next() && rs.getBoolean(1)) return;
                }
                if (System.nanoTime() > deadline) throw new RuntimeException("the connector never started streaming");
                Thread.sleep(200);
            }
        }
    }

    /** The root cause: its class and message, then the first frame outside the JDK. */
    static String cause(Throwable t) {
        while (t.getCause() != null && t.getCause() != t) t = t.getCause();
        StringBuilder sb = new StringBuilder(t.getClass().getName()).append(": ").append(t.getMessage()).append('\n');
        for (StackTraceElement f : t.getStackTrace()) {
            if (!f.getClassName().startsWith("java.")) {
                sb.append("    at ").append(f.getClassName()).append('.').append(f.getMethodName()).append('\n');
                break;
            }
        }
        return sb.toString();
    }

    static String bytes(byte[] b) {
        if (b == null) return "null";
        try {
            String s = StandardCharsets.UTF_8.newDecoder()
                    .onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT)
                    .decode(ByteBuffer.wrap(b))
                    .toString();
            return jsonString(s);
        } catch (CharacterCodingException e) {
            return "{\"base64\": \"" + Base64.getEncoder().encodeToString(b) + "\"}";
        }
    }

    static String jsonString(String s) {
        StringBuilder sb = new StringBuilder(s.length() + 2).append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': sb.append("\\\""); break;
                case '\\': sb.append("\\\\"); break;
                case '\n': sb.append("\\n"); break;
                case '\r': sb.append("\\r"); break;
                case '\t': sb.append("\\t"); break;
                default:
                    if (c < 0x20 || c == 0x7f) sb.append(String.format("\\u%04x", (int) c));
                    else sb.append(c);
            }
        }
        return sb.append('"').toString();
    }
}
