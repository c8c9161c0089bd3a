import PyfaCUDADriver
#if canImport(Glibc)
import Glibc
#endif

/// Compiles embedded CUDA kernels with NVRTC for one architecture and caches
/// the CUBINs on disk. Needs no GPU or driver (CI compiles with it too).
///
/// A specialisation's entry point is generated: for registry name `n` with
/// function constants c0, c1, ...:
///   extern "C" __global__ void __launch_bounds__(<max threads>[, PYFA_MIN_BLOCKS_n(c0, c1, ...)])
/// where <max threads> is the registry's, or PYFA_MAX_THREADS_n(c0, c1, ...) where the source defines it.
///   <entry>(const __grid_constant__ pyfa_cuda_args a) { pyfa_entry_prologue(); n_body<c0, c1, ...>(a); }
/// The minimum of resident blocks per SM (a register cap) appears only where the
/// source defines the macro PYFA_MIN_BLOCKS_n(...) of the specialisation's
/// constants: even a minimum of 1 changes ptxas's register
/// choice (flash_attn_vec at D=256 went from 165 to 191 registers, 3 to 2 blocks per SM).
final class CUDACompiler {
    let arch: String
    let nvrtcVersion: (Int32, Int32)
    let extraOptions: [String]
    private let cacheDir: String?

    /// Loads NVRTC (see pyfa_cuda_nvrtc_load for the search order).
    init(arch: String, extraOptions: [String] = []) throws {
        self.arch = arch
        var err = [CChar](repeating: 0, count: 1024)
        var from = [CChar](repeating: 0, count: 1024)
        let fallback = currentNvrtcPath()
        let status = fallback.withOptionalCString { pyfa_cuda_nvrtc_load($0, &err, err.count, &from, from.count) }
        if status != 0 { throw PyfaError.unavailable(String(cString: err)) }
        var major: Int32 = 0, minor: Int32 = 0
        _ = pyfa_nvrtc.nvrtcVersion(&major, &minor)
        nvrtcVersion = (major, minor)
        self.extraOptions = extraOptions
        cacheDir = CUDACompiler.cacheDirectory()
    }

    /// PYFA_CUDA_COMPILE_LOG=2 adds ptxas's resource report (registers, stack,
    /// spill bytes per entry) to the log that =1 prints.
    var options: [String] {
        ["-arch=\(arch)", "-std=c++17", "-default-device", "-lineinfo", "-diag-suppress=177"] + extraOptions
            + (CUDAPlan.envInt("PYFA_CUDA_COMPILE_LOG", 0) >= 2 ? ["--ptxas-options=-v"] : [])
    }

    /// Every entry's first step (sm_90 and later). A kernel launched with
    /// programmatic stream serialisation (CUDAQueue.dependentLaunch) may start
    /// while the kernel before it in the stream is still running: it waits
    /// here until that kernel has completed and its memory is visible, before
    /// reading or writing anything, so the order of reads and writes is that
    /// of a plain launch; then it lets the kernel after it be scheduled. Both
    /// instructions do nothing for a plain launch.
    static let entryPrologue = """
        __device__ __forceinline__ void pyfa_entry_prologue() {
        #if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            asm volatile("griddepcontrol.wait;" ::: "memory");
            asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        #endif
        }

        """

    static func entryName(_ name: String, _ constants: [Int32]) -> String {
        name + "__fc" + constants.map { $0 < 0 ? "m\(-Int($0))" : String($0) }.joined(separator: "_")
    }

    /// Options of a compile check: kernels may keep one copy of their body
    /// behind a call (PYFA_COMPILE_CHECK) and ptxas compiles functions once
    /// (-rdc), so hundreds of specialisations build in seconds, not minutes.
    static let checkOptions = ["-DPYFA_COMPILE_CHECK=1", "-rdc=true"]

    /// One CUBIN holding the entry points of `name` for every constants list.
    func cubin(name: String, specialisations: [[Int32]], check: Bool = false) throws -> [UInt8] {
        let options = self.options + (check ? CUDACompiler.checkOptions : [])
        var maxThreads: UInt32 = 0
        guard let file = pyfa_cuda_kernel_file(name, &maxThreads) else {
            throw PyfaError.unsupported("kernel '\(name)': no CUDA implementation yet (shaders/cuda/kernel_list.h)")
        }
        var source = try CUDACompiler.embedded(String(cString: file)) + "\n"
        // A source may ask for a minimum of resident blocks per SM (a register
        // cap), per specialisation: PYFA_MIN_BLOCKS_n(c0, c1, ...); and for
        // fewer threads a block than the registry's most, PYFA_MAX_THREADS_n(c0, c1, ...).
        let minBlocks = "PYFA_MIN_BLOCKS_\(name)", threads = "PYFA_MAX_THREADS_\(name)"
        source += "#ifndef \(threads)\n#define \(threads)(...) \(maxThreads)\n#endif\n"
        source += "#ifdef \(minBlocks)\n#define PYFA_LAUNCH_BOUNDS_\(name)(...) __launch_bounds__(\(threads)(__VA_ARGS__), "
        source += "\(minBlocks)(__VA_ARGS__))\n"
        source += "#else\n#define PYFA_LAUNCH_BOUNDS_\(name)(...) __launch_bounds__(\(threads)(__VA_ARGS__))\n#endif\n"
        source += CUDACompiler.entryPrologue
        for c in specialisations {
            let args = c.map { String($0) }.joined(separator: ", ")
            source += "extern \"C\" __global__ void PYFA_LAUNCH_BOUNDS_\(name)(\(args)) \(CUDACompiler.entryName(name, c))"
            source += "(const __grid_constant__ pyfa_cuda_args a) { pyfa_entry_prologue(); \(name)_body<"
            source += c.map { String($0) }.joined(separator: ", ") + ">(a); }\n"
        }
        let headers = CUDACompiler.headerFiles()
        var keyText = source + "\u{1}" + options.joined(separator: " ") + "\u{1}nvrtc \(nvrtcVersion.0).\(nvrtcVersion.1)"
        for (n, text) in headers { keyText += "\u{1}" + n + "\u{1}" + text }
        let key = DiskCache.key(keyText)
        if let dir = cacheDir, let hit = DiskCache.load(dir: dir, key: key) { return hit }
        let image = try compile(source: source, fileName: file, headers: headers, name: name, options: options)
        if let dir = cacheDir { DiskCache.store(dir: dir, key: key, payload: image) }
        return image
    }

    private func compile(source: String, fileName: UnsafePointer<CChar>, headers: [(String, String)],
                         name: String, options: [String]) throws -> [UInt8] {
        var program: nvrtcProgram? = nil
        let texts = headers.map { strdup($0.1) }
        let names = headers.map { strdup($0.0) }
        defer { (texts + names).forEach { free($0) } }
        var textPtrs = texts.map { UnsafePointer<CChar>($0) }
        var namePtrs = names.map { UnsafePointer<CChar>($0) }
        var r = textPtrs.withUnsafeMutableBufferPointer { t in
            namePtrs.withUnsafeMutableBufferPointer { n in
                pyfa_nvrtc.nvrtcCreateProgram(&program, source, fileName, Int32(headers.count),
                                              UnsafePointer(t.baseAddress), UnsafePointer(n.baseAddress))
            }
        }
        guard r == 0, let program else { throw PyfaError.compile("kernel '\(name)': nvrtcCreateProgram failed (\(r))") }
        defer { var p: nvrtcProgram? = program; _ = pyfa_nvrtc.nvrtcDestroyProgram(&p) }
        let opts = options.map { strdup($0) }
        defer { opts.forEach { free($0) } }
        var optPtrs = opts.map { UnsafePointer<CChar>($0) }
        r = optPtrs.withUnsafeMutableBufferPointer { pyfa_nvrtc.nvrtcCompileProgram(program, Int32(opts.count), UnsafePointer($0.baseAddress)) }
        func programLog() -> String {
            var logSize = 0
            _ = pyfa_nvrtc.nvrtcGetProgramLogSize(program, &logSize)
            var log = [CChar](repeating: 0, count: max(logSize, 1))
            _ = pyfa_nvrtc.nvrtcGetProgramLog(program, &log)
            return String(cString: log)
        }
        if r != 0 {
            let why = pyfa_nvrtc.nvrtcGetErrorString(r).map { String(cString: $0) } ?? "error \(r)"
            throw PyfaError.compile("kernel '\(name)' for \(arch): \(why)\n\(programLog())")
        }
        // PYFA_CUDA_COMPILE_LOG=1 (or 2): NVRTC's log of a successful compile
        // (ptxas's warnings, such as wgmma products it had to serialise) on stderr.
        if CUDAPlan.envInt("PYFA_CUDA_COMPILE_LOG", 0) != 0 {
            let log = programLog()
            if !log.isEmpty { fputs("kernel '\(name)' for \(arch):\n" + log + "\n", stderr) }
        }
        var size = 0
        _ = pyfa_nvrtc.nvrtcGetCUBINSize(program, &size)
        var image = [UInt8](repeating: 0, count: size)
        _ = image.withUnsafeMutableBytes { pyfa_nvrtc.nvrtcGetCUBIN(program, $0.baseAddress!.assumingMemoryBound(to: CChar.self)) }
        return image
    }

    static func embedded(_ file: String) throws -> String {
        var length = 0
        guard let text = pyfa_cuda_source(file, &length) else {
            throw PyfaError.internal("CUDA source \(file) is not embedded in this library")
        }
        return String(cString: text)
    }

    /// Every embedded file, offered to NVRTC as an include.
    static func headerFiles() -> [(String, String)] {
        var out: [(String, String)] = []
        var i = 0
        while let n = pyfa_cuda_source_name(i) {
            let name = String(cString: n)
            if !name.hasSuffix(".cu"), let text = try? embedded(name) { out.append((name, text)) }
            i += 1
        }
        return out
    }

    /// $PYFA_CACHE_DIR, else $XDG_CACHE_HOME/pyfa, else ~/.cache/pyfa; "cuda" inside.
    /// PYFA_CACHE_DIR=off disables the disk cache.
    static func cacheDirectory() -> String? {
        func env(_ n: String) -> String? { getenv(n).map { String(cString: $0) }.flatMap { $0.isEmpty ? nil : $0 } }
        let base: String
        if let d = env("PYFA_CACHE_DIR") {
            if d == "off" { return nil }
            base = d
        } else if let x = env("XDG_CACHE_HOME") {
            base = x + "/pyfa"
        } else if let h = env("HOME") {
            base = h + "/.cache/pyfa"
        } else {
            return nil
        }
        return base + "/cuda"
    }
}

extension Optional where Wrapped == String {
    func withOptionalCString<R>(_ body: (UnsafePointer<CChar>?) -> R) -> R {
        switch self {
        case .some(let s): return s.withCString { body($0) }
        case .none: return body(nil)
        }
    }
}

/// Content-addressed CUBIN files: `<key>.cubin` = magic, payload length,
/// payload checksum, payload. Written to a temporary name and renamed, so a
/// reader never sees half a file; an entry that fails its checks is rebuilt.
enum DiskCache {
    static let magic: [UInt8] = Array("PYFACUB1".utf8)

    static func fnv1a(_ bytes: UnsafeRawBufferPointer, seed: UInt64) -> UInt64 {
        var h: UInt64 = seed
        for b in bytes { h = (h ^ UInt64(b)) &* 0x100000001b3 }
        return h
    }

    static func key(_ text: String) -> String {
        var t = text
        return t.withUTF8 { u in
            let raw = UnsafeRawBufferPointer(u)
            let a = fnv1a(raw, seed: 0xcbf29ce484222325), b = fnv1a(raw, seed: 0x84222325cbf29ce4)
            return hex(a) + hex(b)
        }
    }

    static func hex(_ v: UInt64) -> String {
        let s = String(v, radix: 16)
        return String(repeating: "0", count: 16 - s.count) + s
    }

    static func load(dir: String, key: String) -> [UInt8]? {
        guard let f = fopen(dir + "/" + key + ".cubin", "rb") else { return nil }
        defer { fclose(f) }
        var header = [UInt8](repeating: 0, count: 24)
        guard fread(&header, 1, 24, f) == 24, Array(header[0..<8]) == magic else { return nil }
        let length = header[8..<16].enumerated().reduce(UInt64(0)) { $0 | UInt64($1.element) << (8 * UInt64($1.offset)) }
        let sum = header[16..<24].enumerated().reduce(UInt64(0)) { $0 | UInt64($1.element) << (8 * UInt64($1.offset)) }
        guard length > 0, length < 1 << 30 else { return nil }
        var payload = [UInt8](repeating: 0, count: Int(length))
        guard fread(&payload, 1, Int(length), f) == Int(length) else { return nil }
        guard payload.withUnsafeBytes({ fnv1a($0, seed: 0xcbf29ce484222325) }) == sum else { return nil }
        return payload
    }

    static func store(dir: String, key: String, payload: [UInt8]) {
        makeDirectories(dir)
        let tmp = dir + "/." + key + ".\(getpid()).\(UInt32.random(in: 0...UInt32.max)).tmp"
        guard let f = fopen(tmp, "wb") else { return }
        var header = magic
        let sum = payload.withUnsafeBytes { fnv1a($0, seed: 0xcbf29ce484222325) }
        for v in [UInt64(payload.count), sum] { for i in 0..<8 { header.append(UInt8(truncatingIfNeeded: v >> (8 * UInt64(i)))) } }
        let ok = fwrite(header, 1, header.count, f) == header.count && fwrite(payload, 1, payload.count, f) == payload.count
        if fclose(f) == 0 && ok {
            if rename(tmp, dir + "/" + key + ".cubin") != 0 { unlink(tmp) }
        } else {
            unlink(tmp)
        }
    }

    static func makeDirectories(_ path: String) {
        var prefix = path.hasPrefix("/") ? "" : "."
        for part in path.split(separator: "/") {
            prefix += "/" + part
            mkdir(prefix, 0o755)
        }
    }
}
